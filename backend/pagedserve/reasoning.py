"""Reasoning content as vLLM's `--reasoning-parser` separates it: what a thinking model (Qwen3,
DeepSeek-R1, QwQ) writes between `<think>` and `</think>` leaves as `reasoning_content`, the rest as
the answer. Both parsers read the same tags; their names are vLLM's, so deployments carry over.

A completion starts inside its reasoning when it begins with `<think>`, or when the prompt left a
think block open (Qwen3-Thinking's and DeepSeek-R1's templates end the prompt with `<think>`, so
the model writes only the closing tag); then everything up to `</think>` is reasoning, also when no
`</think>` comes (a completion cut short while thinking gave reasoning only). Torch-free."""

from __future__ import annotations

from pagedserve.tool_calls import partial_suffix

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether the prompt's last text leaves a think block open (a `<think>` after the last `</think>`)."""
    return prompt_tail.rfind(START) > prompt_tail.rfind(END)


class ReasoningParser:
    """One completion's text in, as it streams; its reasoning and its content out. What may be the
    beginning of a tag is held back until it is one or is not."""

    def __init__(self, open_at_start: bool) -> None:
        self._state = "reasoning" if open_at_start else "start"  # start: is a <think> coming?
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._pending:
            if self._state == "start":
                head = self._pending.lstrip()
                if head.startswith(START):
                    self._pending, self._state = head[len(START) :], "reasoning"
                elif START.startswith(head):  # whitespace, or a <think> begun: wait
                    break
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                end = self._pending.find(END)
                if end < 0:
                    keep = partial_suffix(self._pending, END)
                    reasoning.append(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                reasoning.append(self._pending[:end])
                self._pending, self._state = self._pending[end + len(END) :], "content"
            else:
                content.append(self._pending)
                self._pending = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """At the completion's end: what was held back."""
        rest, self._pending = self._pending, ""
        return (rest, "") if self._state == "reasoning" else ("", rest)


def split_reasoning(text: str, open_at_start: bool = False) -> tuple[str, str]:
    """A whole output's reasoning and content (for offline use: `LLM.chat` output)."""
    parser = ReasoningParser(open_at_start)
    reasoning, content = parser.feed(text)
    more, rest = parser.finish()
    return reasoning + more, content + rest

"""Reasoning content as vLLM's `--reasoning-parser` separates it: what a thinking model (Qwen3,
DeepSeek-R1, QwQ, OLMo 3 Think, GLM-4.5) writes between `<think>` and `</think>` leaves as
`reasoning_content`, the rest as the answer. `deepseek_r1`, `glm45`, `olmo3` and `qwen3` read the same
tags, as text (OLMo 3's are plain text; the others' are added tokens the text keeps); their names
are vLLM's, so deployments carry over.
`mistral` reads Magistral's `[THINK]` and `[/THINK]` the same way (special tokens, kept in a chat's
text under it: `rpc.convert.keep_special_tokens`), `seed_oss` Seed-OSS's `<seed:think>` and
`</seed:think>` (added tokens the text keeps). `deepseek_v3` reads DeepSeek-V3.1's `<think>` tags
(its template ends a thinking prompt with `<think>`, a non-thinking one with `</think>`), `kimi_k2`
Kimi K2's (special tokens, kept; its reasoning also ends where a tool call begins, which the model may
write without closing the block). `openai_gptoss` reads GPT-OSS's harmony format instead
(`HarmonyParser`).

A completion starts inside its reasoning when it begins with `<think>`, or when the prompt left a
think block open (Qwen3-Thinking's, DeepSeek-R1's and OLMo 3 Think's templates end the prompt with
`<think>`, so the model writes only the closing tag); then everything up to `</think>` is reasoning,
also when no `</think>` comes (a completion cut short while thinking gave reasoning only).
Torch-free."""

from __future__ import annotations

import re

from pagedserve.tool_calls import HARMONY_CHANNEL, HARMONY_ENDS, HARMONY_MESSAGE, partial_suffix

REASONING_PARSERS = (
    "deepseek_r1",
    "deepseek_v3",
    "glm45",
    "kimi_k2",
    "mistral",
    "olmo3",
    "openai_gptoss",
    "qwen3",
    "seed_oss",
)
START, END = "<think>", "</think>"
# the parsers whose tags are others (the rest read START and END)
TAGS = {"mistral": ("[THINK]", "[/THINK]"), "seed_oss": ("<seed:think>", "</seed:think>")}
# the parsers whose markers are special tokens, to be kept in a chat's text for them
READS_SPECIAL_TOKENS = ("kimi_k2", "mistral", "openai_gptoss")
# what else ends a parser's reasoning and begins its content (Kimi K2's tool calls: its model may call
# a tool without closing its think block first)
HANDOFFS = {"kimi_k2": ("<|tool_calls_section_begin|>", "<|tool_call_begin|>")}
# a harmony message's recipient (`to=functions.get_weather`), in its role's part or its channel's
_RECIPIENT = re.compile(r" to=([^\s<]+)")


def prompt_opens_reasoning(prompt_tail: str, name: str = "") -> bool:
    """Whether the prompt's last text leaves a think block open (a `<think>` after the last `</think>`;
    parser `name`'s own tags where it has some)."""
    start, end = TAGS.get(name, (START, END))
    return prompt_tail.rfind(start) > prompt_tail.rfind(end)


class ReasoningParser:
    """One completion's text in, as it streams; its reasoning and its content out. What may be the
    beginning of a tag is held back until it is one or is not."""

    def __init__(
        self, open_at_start: bool, start: str = START, end: str = END, handoffs: tuple[str, ...] = ()
    ) -> None:
        self._state = "reasoning" if open_at_start else "start"  # start: is a <think> coming?
        self._pending = ""
        self._start, self._end = start, end
        self._handoffs = handoffs  # tags that end the reasoning and stay, beginning the content

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._pending:
            if self._state == "start":
                head = self._pending.lstrip()
                if head.startswith(self._start):
                    self._pending, self._state = head[len(self._start) :], "reasoning"
                elif self._start.startswith(head):  # whitespace, or a <think> begun: wait
                    break
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                tags = (self._end, *self._handoffs)
                ends = [(at, tag) for tag in tags if (at := self._pending.find(tag)) >= 0]
                if not ends:
                    keep = max(partial_suffix(self._pending, tag) for tag in tags)
                    reasoning.append(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                end, tag = min(ends)
                reasoning.append(self._pending[:end])
                after = end + len(tag) if tag == self._end else end  # (a handoff stays)
                self._pending, self._state = self._pending[after:], "content"
            else:
                content.append(self._pending)
                self._pending = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """At the completion's end: what was held back."""
        rest, self._pending = self._pending, ""
        return (rest, "") if self._state == "reasoning" else ("", rest)


class HarmonyParser:
    """GPT-OSS's completion in OpenAI's harmony format, its special tokens kept in the text: messages

        [<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY<|end|>

    (the prompt opens the first one with `<|start|>assistant`; the last ends with `<|return|>`, the
    EOS, left out of the text, or `<|call|>`). The bodies of `analysis` messages are reasoning, the
    others' (`final`, `commentary`) content; the headers and ends are dropped. A message to a
    recipient (a tool call: `to=functions.NAME`) stays whole in the content, its header as
    `<|channel|>CHANNEL to=RECIPIENT<|message|>`, for `--tool-call-parser openai`
    (`tool_calls.HarmonyCallParser`). Text that opens with no header (a model that does not write
    harmony) is content. What may be the beginning of a header or an end is held back until it is
    one or is not."""

    def __init__(self) -> None:
        self._channel: str | None = None  # the message being read; None: between messages
        self._to_recipient = False  # the message is a call: passed on whole
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._pending:
            if self._channel is None:
                header = self._read_header()
                if header is None:
                    break
                content.append(header)
                continue
            ends = [(i, tag) for tag in HARMONY_ENDS if (i := self._pending.find(tag)) >= 0]
            body = reasoning if self._channel == "analysis" and not self._to_recipient else content
            if not ends:
                keep = max(partial_suffix(self._pending, tag) for tag in HARMONY_ENDS)
                body.append(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                break
            end, tag = min(ends)
            body.append(self._pending[:end] + (tag if self._to_recipient else ""))
            self._pending, self._channel = self._pending[end + len(tag) :], None
        return "".join(reasoning), "".join(content)

    def _read_header(self) -> str | None:
        """Past a whole header, its channel set: what of it passes on (a call's header, else nothing);
        None while one is begun but not ended."""
        head = self._pending.lstrip()
        if not head.startswith("<|") and not "<|".startswith(head):
            self._channel, self._to_recipient = "final", False  # no harmony: the text is the answer
            return ""
        end = self._pending.find(HARMONY_MESSAGE)
        if end < 0:
            return None
        header = self._pending[:end]
        after = header.rfind(HARMONY_CHANNEL)
        channel = header[after + len(HARMONY_CHANNEL) :].split("<|")[0].split(" ")[0] if after >= 0 else ""
        self._channel = channel or "final"
        self._pending = self._pending[end + len(HARMONY_MESSAGE) :]
        recipient = _RECIPIENT.search(header)
        self._to_recipient = recipient is not None
        if recipient is None:
            return ""
        return f"{HARMONY_CHANNEL}{self._channel} to={recipient[1]}{HARMONY_MESSAGE}"

    def finish(self) -> tuple[str, str]:
        """At the completion's end: a body held back is its channel's; a header cut short is dropped."""
        rest, self._pending = self._pending, ""
        if self._channel is None:
            return "", ""
        return (rest, "") if self._channel == "analysis" and not self._to_recipient else ("", rest)


def new_parser(name: str, open_at_start: bool) -> ReasoningParser | HarmonyParser:
    """The `--reasoning-parser` `name`'s parser for one completion (`open_at_start`: see
    `ReasoningParser`; harmony's messages say their channel themselves)."""
    if name == "openai_gptoss":
        return HarmonyParser()
    return ReasoningParser(open_at_start, *TAGS.get(name, (START, END)), handoffs=HANDOFFS.get(name, ()))


def split_reasoning(text: str, open_at_start: bool = False) -> tuple[str, str]:
    """A whole output's reasoning and content (for offline use: `LLM.chat` output)."""
    parser = ReasoningParser(open_at_start)
    reasoning, content = parser.feed(text)
    more, rest = parser.finish()
    return reasoning + more, content + rest

"""Reasoning split (pagedserve.reasoning): the text between <think> and </think> found however the stream
is cut, the tags dropped, nothing else lost. The gRPC end of it: tests/e2e/test_grpc_reasoning.py."""

from __future__ import annotations

import pytest
from pagedserve.reasoning import (
    READS_SPECIAL_TOKENS,
    HarmonyParser,
    ReasoningParser,
    new_parser,
    prompt_opens_reasoning,
    split_reasoning,
)

THOUGHT = "<think>\nThe user wants 2 + 2.\n</think>\n\nIt is 4."


def run(parser: ReasoningParser | HarmonyParser, pieces: list[str]) -> list[tuple[str, str]]:
    return [parser.feed(piece) for piece in pieces] + [parser.finish()]


def joined(parts: list[tuple[str, str]]) -> tuple[str, str]:
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


def test_the_split_is_the_same_wherever_the_stream_is_cut() -> None:
    expected = ("\nThe user wants 2 + 2.\n", "\n\nIt is 4.")
    for cut in range(len(THOUGHT) + 1):
        for cut2 in range(cut, min(cut + 4, len(THOUGHT)) + 1):
            pieces = [THOUGHT[:cut], THOUGHT[cut:cut2], THOUGHT[cut2:]]
            assert joined(run(ReasoningParser(False), pieces)) == expected, (cut, cut2)
    assert joined(run(ReasoningParser(False), list(THOUGHT))) == expected


def test_reasoning_streams_as_it_comes_holding_back_only_a_tag_begun() -> None:
    parser = ReasoningParser(False)
    assert parser.feed("  <thi") == ("", "")  # may be <think>
    assert parser.feed("nk>Let me") == ("Let me", "")
    assert parser.feed(" see.</th") == (" see.", "")
    assert parser.feed("ink>Done") == ("", "Done")
    assert parser.feed(" <think> is text now") == ("", " <think> is text now")
    assert parser.finish() == ("", "")


def test_a_prompt_that_opened_the_block_makes_the_output_reasoning_until_it_closes() -> None:
    """Qwen3-Thinking and DeepSeek-R1 templates end the prompt with <think>: the model writes only the
    closing tag. Cut short while thinking, a completion gave reasoning only."""
    assert split_reasoning("Hmm, 4.</think>\n\nIt is 4.", open_at_start=True) == ("Hmm, 4.", "\n\nIt is 4.")
    assert split_reasoning("Hmm, still thinking </thi", open_at_start=True) == (
        "Hmm, still thinking </thi",
        "",
    )
    assert split_reasoning("Hmm", open_at_start=False) == ("", "Hmm")


@pytest.mark.parametrize(
    ("output", "split"),
    [
        ("No tags at all.", ("", "No tags at all.")),
        ("Text first <think>then this</think>", ("", "Text first <think>then this</think>")),
        ("<think>unclosed", ("unclosed", "")),
        ("<think></think>", ("", "")),
        ("<thin", ("", "<thin")),
        ("   ", ("", "   ")),
        ("\n<think>a</think>b</think>", ("a", "b</think>")),
    ],
)
def test_only_a_block_at_the_start_is_reasoning(output: str, split: tuple[str, str]) -> None:
    assert split_reasoning(output) == split


def test_the_prompts_last_block_decides_whether_it_is_open() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking off
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert prompt_opens_reasoning("</think> earlier turn <think>")


def test_olmo3_reads_olmo_3_thinks_output_after_its_open_block() -> None:
    """OLMo 3 Think's template ends the prompt with `<think>` (plain text in its vocabulary, as the
    closing tag is): vLLM's `olmo3` is the same split."""
    prompt_tail = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n<think>"
    parser = new_parser("olmo3", prompt_opens_reasoning(prompt_tail))
    assert joined(run(parser, ["The user wants", " 2 + 2.</th", "ink>It is 4."])) == (
        "The user wants 2 + 2.",
        "It is 4.",
    )


def test_glm45_reads_glm_4_5s_think_tags() -> None:
    """vLLM's glm45: GLM-4.5 writes its own <think> (or its template closes an empty block when
    thinking is off): the same split as qwen3's."""
    parser = new_parser("glm45", prompt_opens_reasoning("<|user|>\nHi<|assistant|>", "glm45"))
    assert joined(run(parser, ["<think>Say hello.</thi", "nk>Hello!"])) == ("Say hello.", "Hello!")
    closed = "<|assistant|>\n<think></think>\n"
    assert not prompt_opens_reasoning(closed, "glm45")


def test_seed_oss_reads_its_own_think_tags() -> None:
    """vLLM's seed_oss: Seed-OSS thinks between <seed:think> and </seed:think>."""
    parser = new_parser("seed_oss", prompt_opens_reasoning("<seed:bos>assistant\n", "seed_oss"))
    output = "<seed:think>Two and two.</seed:think>Four."
    assert joined(run(parser, [output[:9], output[9:30], output[30:]])) == ("Two and two.", "Four.")
    assert joined(run(new_parser("seed_oss", False), ["<think>a</think>b"])) == ("", "<think>a</think>b")


def test_mistral_reads_magistrals_think_tokens_and_no_other_tags() -> None:
    """vLLM's mistral: Magistral thinks between [THINK] and [/THINK] (special tokens, kept in the
    text); <think> is text to it, and a prompt ending in [THINK] opens the block."""
    output = "[THINK]The user wants 2 + 2.[/THINK]It is 4."
    for cut in range(len(output) + 1):
        parser = new_parser("mistral", open_at_start=False)
        assert joined(run(parser, [output[:cut], output[cut:]])) == ("The user wants 2 + 2.", "It is 4."), cut
    assert joined(run(new_parser("mistral", False), ["<think>a</think>b"])) == ("", "<think>a</think>b")
    assert prompt_opens_reasoning("[INST]What is 2 + 2?[/INST][THINK]", "mistral")
    assert not prompt_opens_reasoning("[INST]What is 2 + 2?[/INST][THINK]", "qwen3")
    assert not prompt_opens_reasoning("[THINK]earlier[/THINK][INST]Hi[/INST]", "mistral")


def test_deepseek_v3_thinks_where_deepseek_v31s_prompt_opens_the_block() -> None:
    """vLLM's deepseek_v3: DeepSeek-V3.1's template ends a thinking prompt with <think> and a
    non-thinking one with </think>; the output is reasoning until </think> in the first case alone."""
    thinking = "<｜User｜>2 + 2?<｜Assistant｜><think>"
    plain = "<｜User｜>2 + 2?<｜Assistant｜></think>"
    output = "Two and two.</think>It is 4."
    opens = prompt_opens_reasoning(thinking, "deepseek_v3")
    assert opens and not prompt_opens_reasoning(plain, "deepseek_v3")
    assert joined(run(new_parser("deepseek_v3", opens), [output])) == ("Two and two.", "It is 4.")
    assert joined(run(new_parser("deepseek_v3", False), ["It is 4."])) == ("", "It is 4.")


@pytest.mark.parametrize(
    ("output", "split"),
    [
        ("<think>Two and two.</think>It is 4.", ("Two and two.", "It is 4.")),
        # a tool call written before the block closes ends the reasoning and stays, for the tool parser
        (
            "<think>Weather first.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0",
            ("Weather first.", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"),
        ),
        (
            "<think>Weather first.<|tool_call_begin|>functions.f:0<|tool_call_end|>",
            ("Weather first.", "<|tool_call_begin|>functions.f:0<|tool_call_end|>"),
        ),
    ],
    ids=["closed", "section-begins", "call-begins"],
)
def test_kimi_k2s_reasoning_ends_at_its_close_or_at_a_tool_call(output: str, split: tuple[str, str]) -> None:
    """vLLM's kimi_k2: Kimi K2 Thinking's <think> tags (special tokens, kept in a chat's text), its
    reasoning also ended by a tool-call section begun without </think>, wherever the stream is cut."""
    for cut in range(len(output) + 1):
        assert joined(run(new_parser("kimi_k2", False), [output[:cut], output[cut:]])) == split, cut
    assert "kimi_k2" in READS_SPECIAL_TOKENS
    if "</think>" not in output:  # (the handoff is Kimi's: DeepSeek-R1's reasoning runs on through them)
        assert joined(run(new_parser("deepseek_r1", False), [output])) == (output.removeprefix("<think>"), "")


# --- GPT-OSS's harmony messages (--reasoning-parser openai_gptoss) ---------------------------------

# as gpt-oss writes a completion after its template's `<|start|>assistant`: a message on the analysis
# channel, then one on the final channel (the closing <|return|> is the EOS, out of the text)
HARMONY = (
    "<|channel|>analysis<|message|>The user wants 2 + 2.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is 4."
)


def test_harmony_analysis_is_reasoning_and_final_is_content_wherever_the_stream_is_cut() -> None:
    expected = ("The user wants 2 + 2.", "It is 4.")
    for cut in range(len(HARMONY) + 1):
        for cut2 in range(cut, min(cut + 5, len(HARMONY)) + 1):
            pieces = [HARMONY[:cut], HARMONY[cut:cut2], HARMONY[cut2:]]
            assert joined(run(HarmonyParser(), pieces)) == expected, (cut, cut2)
    assert joined(run(HarmonyParser(), list(HARMONY))) == expected


def test_harmony_streams_bodies_as_they_come_holding_back_only_a_marker_begun() -> None:
    parser = HarmonyParser()
    assert parser.feed("<|channel|>analy") == ("", "")  # a header: nothing until <|message|>
    assert parser.feed("sis<|message|>Let me") == ("Let me", "")
    assert parser.feed(" see.<|e") == (" see.", "")  # may be <|end|>
    assert parser.feed("nd|><|start|>assistant<|channel|>final<|message|>Four") == ("", "Four")
    assert parser.feed("<|ca") == ("", "")  # may be <|call|>
    assert parser.finish() == ("", "<|ca")


@pytest.mark.parametrize(
    ("output", "split"),
    [
        # a model that writes no harmony: its text is the answer
        ("Just an answer.", ("", "Just an answer.")),
        ("  plain <|end|> text", ("", "  plain  text")),  # (an end's marker is dropped wherever)
        # cut short while thinking: reasoning only; in a header: nothing
        ("<|channel|>analysis<|message|>Hmm, 4", ("Hmm, 4", "")),
        ("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|chan", ("Hmm.", "")),
        # a tool call's message (commentary to a function, its arguments' type constrained) passes on
        # whole, its header in one form, for the tool-call parser (tests/unit/test_tool_calls.py)
        (
            "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
            (
                "Call it.",
                '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}<|call|>',
            ),
        ),
        # two analysis messages, a commentary preamble, then the answer
        (
            "<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>analysis<|message|>B."
            "<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Done.",
            ("A.B.", "Checking.Done."),
        ),
    ],
)
def test_harmony_messages_split_by_channel(output: str, split: tuple[str, str]) -> None:
    assert joined(run(HarmonyParser(), [output])) == split

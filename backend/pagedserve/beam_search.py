"""Beam search's beams, their score and one prompt's search, as vLLM's `LLM.beam_search` keeps them,
and what a round asks of the engine; the engine calls that extend the beams are `LLM.beam_search`'s
(offline) and `AsyncEngine.beam_search`'s (the servers)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.lora_request import LoRARequest
from pagedserve.outputs import RequestDelta, RequestMetrics, TokenLogprobs
from pagedserve.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam, shaped like vLLM's. `tokens` are the prompt's and the generated ids; `logprobs` one
    entry per generated token: the candidates that step asked for (the beam's top 2 * beam_width, and
    the sampled token), the chosen one among them; `cum_logprob` the sum of the generated tokens'
    logprobs. `text` is set on the beams returned only: `tokens` decoded, prompt and special tokens
    included, as vLLM decodes them. `finish_reason` is "stop" on a beam that ended with an EOS token
    (`stop_reason` its id, as vLLM's) and "length" on one that max_tokens or the context ended (vLLM
    leaves None there)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs]
    lora_request: LoRARequest | None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """One prompt's result, as vLLM's: its best `beam_width` beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(
    beam: BeamSearchSequence, eos_token_ids: frozenset[int], length_penalty: float
) -> float:
    """vLLM's `get_beam_search_score`: the cumulative logprob over the length to the power
    `length_penalty`, where the length counts the prompt's tokens and not a final EOS. (Hugging Face's
    counts the generated tokens, a final EOS among them: the two rank beams of different lengths the
    same only where `length_penalty` is 0.)"""
    length = len(beam.tokens) - (beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / length**length_penalty


class BeamSearch:
    """One prompt's search: its live beams, best first, and the beams set aside as finished.

    Invariant: the live beams are at most `beam_width`, all of one length, and none ends with an EOS
    unless `ignore_eos`; so among them the ranking by score is the ranking by cumulative logprob."""

    def __init__(
        self,
        prompt_token_ids: list[int],
        lora_request: LoRARequest | None,
        params: BeamSearchParams,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.beams = [BeamSearchSequence(list(prompt_token_ids), [], lora_request)]
        self.finished: list[BeamSearchSequence] = []

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(beam, self.eos_token_ids, self.params.length_penalty)

    def extend(self, step_logprobs: list[TokenLogprobs]) -> None:
        """Take one engine step's logprobs, one entry per live beam, in order: every candidate token of
        every beam is a new beam; those ending with an EOS are finished (all of them, as vLLM's: Hugging
        Face keeps only those among the step's best `beam_width`), the best `beam_width` others live on."""
        candidates = []
        for beam, entry in zip(self.beams, step_logprobs, strict=True):
            for token_id, logprob in entry.items():
                new = BeamSearchSequence(
                    beam.tokens + [token_id],
                    beam.logprobs + [entry],
                    beam.lora_request,
                    beam.cum_logprob + logprob.logprob,
                )
                if token_id in self.eos_token_ids and not self.params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", token_id
                    self.finished.append(new)
                else:
                    candidates.append(new)
        candidates.sort(key=self.score, reverse=True)  # stable: ties keep the beams' and logprobs' order
        self.beams = candidates[: self.params.beam_width]

    def end_at_context(self, max_model_len: int) -> None:
        """Finish the live beams that fill the context: the engine has no room for another token."""
        full = [beam for beam in self.beams if len(beam.tokens) >= max_model_len]
        self.beams = [beam for beam in self.beams if len(beam.tokens) < max_model_len]
        self.finish(full, "length")

    def finish(self, beams: list[BeamSearchSequence], reason: str) -> None:
        for beam in beams:
            beam.finish_reason = reason
        self.finished.extend(beams)

    def best(self, decode: Callable[[list[int]], str] | None = None) -> BeamSearchOutput:
        """End the search: the best `beam_width` of the finished and the live beams, with their text
        where `decode` is given (a server decodes their generated tokens alone, off the event loop)."""
        self.finish(self.beams, "length")
        self.beams = []
        ranked = sorted(self.finished, key=self.score, reverse=True)[: self.params.beam_width]
        if decode is not None:
            for beam in ranked:
                beam.text = decode(beam.tokens)
        return BeamSearchOutput(ranked)


def step_params(params: BeamSearchParams) -> SamplingParams:
    """What a round asks of the engine for each live beam: one token, the logprobs of its `2 *
    beam_width` most likely (the beam's candidates), and no text."""
    return SamplingParams(
        temperature=params.temperature, max_tokens=1, logprobs=2 * params.beam_width, detokenize=False
    )


def step_candidates(logprobs: list[TokenLogprobs] | None) -> TokenLogprobs:
    """A beam's candidates from the output of its one-token request: that token's logprobs entry."""
    assert logprobs is not None and len(logprobs) == 1, "a beam's step asks for logprobs of one token"
    return logprobs[0]


def text_token_ids(beam: BeamSearchSequence, num_prompt_tokens: int, include_stop: bool) -> list[int]:
    """The generated tokens whose text a server returns (vLLM's online beam search decodes only the
    generated part): a final EOS left out unless `include_stop` (include_stop_str_in_output), as the
    engine's detokenizer leaves out the EOS that ends any request."""
    ids = beam.tokens[num_prompt_tokens:]
    return ids[:-1] if beam.finish_reason == "stop" and not include_stop else ids


def beam_deltas(
    request_id: str,
    output: BeamSearchOutput,
    num_prompt_tokens: int,
    texts: list[str],
    metrics: RequestMetrics,
) -> list[RequestDelta]:
    """A search's result as a server streams it: one final delta per beam, best first (`index` its
    rank), its generated tokens and `texts[index]`, its `cum_logprob` as `cumulative_logprob`, finish
    reason eos (it ended with an EOS, as the engine names that end) or length; the last delta ends the
    request. `metrics` are the search's."""
    deltas = []
    for index, (beam, text) in enumerate(zip(output.sequences, texts, strict=True)):
        ids = beam.tokens[num_prompt_tokens:]
        reason = "eos" if beam.finish_reason == "stop" else "length"
        metrics.completion_ends[index] = (reason, len(ids))
        deltas.append(
            RequestDelta(
                request_id=request_id,
                new_token_ids=ids,
                new_text=text,
                new_logprobs=None,
                finished=True,
                finish_reason=reason,
                num_prompt_tokens=num_prompt_tokens,
                num_output_tokens=len(ids),
                metrics=metrics,
                index=index,
                request_finished=index == len(output.sequences) - 1,
                cumulative_logprob=beam.cum_logprob,
            )
        )
    metrics.n = len(deltas)
    return deltas

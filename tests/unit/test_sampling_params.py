"""Every invalid sampling parameter is rejected with an error naming its field."""

from __future__ import annotations

import math

import pytest
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import SamplingParams

INVALID = [
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "hot"),
    ("temperature", 10**400),  # an int no float holds: was an OverflowError
    ("repetition_penalty", -(10**400)),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("top_k", 2.5),
    ("top_k", -2),
    ("top_k", True),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 1.5),
    ("min_tokens", -1),
    ("seed", 1.5),
    ("stop", [""]),
    ("stop_token_ids", [-1]),
    ("logprobs", -1),
    ("logprobs", 21),
    ("n", 0),
    ("stop", [f"s{i}" for i in range(65)]),
    ("stop", ["s" * 1025]),
    ("stop_token_ids", [7] * 1025),  # each masked every step below min_tokens: no slowing the batch
    ("detokenize", 0),
    ("detokenize", "false"),  # truthy: would have decoded
    ("spaces_between_special_tokens", None),
    ("spaces_between_special_tokens", 1),
    ("ignore_eos", "yes"),
    ("include_stop_str_in_output", 1),
    ("skip_special_tokens", "no"),  # truthy: would have skipped them
]


@pytest.mark.parametrize(("field", "value"), INVALID)
def test_invalid_value_names_its_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_min_tokens_above_max_tokens_is_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_max_tokens_none_is_vllm_s_until_the_context_is_full() -> None:
    """The engine resolves None per prompt; min_tokens is checked against a max_tokens given only (as
    vLLM checks it): one past the room of some prompt is no error here."""
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(max_tokens=None, min_tokens=10**6).min_tokens == 10**6


def test_valid_values_are_kept() -> None:
    params = SamplingParams(temperature=0, top_p=0.5, top_k=3, stop="###", seed=7, logprobs=2, max_tokens=9)
    assert params.is_greedy and params.stop == ["###"] and params.top_k == 3 and params.logprobs == 2
    assert not params.has_penalties and SamplingParams(presence_penalty=0.5).has_penalties
    assert len(SamplingParams(stop=[f"{i:04}" + "s" * 1020 for i in range(64)]).stop) == 64  # the limits
    assert len(SamplingParams(stop_token_ids=list(range(1024))).stop_token_ids) == 1024


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_zero_or_minus_one_disables_it_as_in_vllm(top_k: int) -> None:
    # vLLM's default is 0 since 0.8: code written for it passes top_k=0 and means "all tokens"
    assert SamplingParams(top_k=top_k).top_k == -1


@pytest.mark.parametrize(
    ("fields", "repetition", "counts"),
    [
        ({}, False, False),
        ({"repetition_penalty": 1.1}, True, False),
        ({"presence_penalty": 0.5}, False, True),
        ({"frequency_penalty": -0.5}, False, True),
        ({"repetition_penalty": 0.9, "frequency_penalty": 0.1}, True, True),
    ],
)
def test_each_kind_of_penalty_is_named_apart(
    fields: dict[str, float], repetition: bool, counts: bool
) -> None:
    """What the model runner reads to build only the penalty tensors some row needs."""
    params = SamplingParams(**fields)  # type: ignore[arg-type]
    assert (params.has_repetition_penalty, params.has_count_penalties) == (repetition, counts)
    assert params.has_penalties == (repetition or counts)


def test_detokenization_flags_default_to_vllm_s() -> None:
    params = SamplingParams()
    assert params.detokenize is True and params.spaces_between_special_tokens is True
    params = SamplingParams(detokenize=False, spaces_between_special_tokens=False, stop_token_ids=[7])
    assert params.detokenize is False and params.spaces_between_special_tokens is False
    assert params.stop_token_ids == [7]  # ids need no text: kept without detokenizing


def test_stop_strings_without_detokenize_are_refused_as_vllm_refuses_them() -> None:
    """Stop strings are matched against the text, which detokenize=False never makes."""
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(detokenize=False, stop="###")
    assert info.value.field == "stop"
    assert info.value.message == (
        "stop strings are only supported when detokenize is True. Set detokenize=True to use stop."
    )


def test_every_field_is_honoured_by_beam_search_or_refused_with_it() -> None:
    """The front ends' beam search rule covers every sampling field: a new one must be placed on one
    side (and NOT_IN_BEAM_SEARCH's values that leave a field off are its defaults)."""
    import dataclasses

    from pagedserve.sampling_params import BEAM_SEARCH_FIELDS, NOT_IN_BEAM_SEARCH, check_beam_search_field

    public = {f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_")}
    assert public == set(BEAM_SEARCH_FIELDS) | set(NOT_IN_BEAM_SEARCH)
    assert not set(BEAM_SEARCH_FIELDS) & set(NOT_IN_BEAM_SEARCH)
    defaults = SamplingParams()
    for name in NOT_IN_BEAM_SEARCH:  # (None is unset: a front end checks only the fields a request sets)
        if getattr(defaults, name) is not None:
            check_beam_search_field(name, getattr(defaults, name))
    with pytest.raises(InvalidRequestError) as caught:
        check_beam_search_field("top_k", 5, "sampling_parameters.top_k")
    assert caught.value.field == "sampling_parameters.top_k" and "(or 0)" in caught.value.message


def test_a_servers_beam_search_keeps_only_the_fields_it_honours() -> None:
    """BeamSearchParams.from_request takes a request's parameters with the model's defaults filled in:
    the search's width, temperature, length and EOS flags come from them, and a model default beam search
    does not apply (generation_config's top_p, say) is dropped, not carried as if it ran."""
    from pagedserve.sampling_params import BeamSearchParams

    given = SamplingParams(
        n=3, temperature=0.5, max_tokens=7, top_p=0.9, top_k=20, ignore_eos=True, skip_special_tokens=False
    )
    honoured, search = BeamSearchParams.from_request(given, length_penalty=0.5)
    assert (honoured.top_p, honoured.top_k) == (SamplingParams().top_p, SamplingParams().top_k)
    assert (honoured.n, honoured.max_tokens, honoured.skip_special_tokens) == (3, 7, False)
    assert search == BeamSearchParams(
        beam_width=3, max_tokens=7, ignore_eos=True, temperature=0.5, length_penalty=0.5
    )

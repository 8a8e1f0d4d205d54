"""SamplingParams: validation names the field, instances are immutable."""

from __future__ import annotations

import dataclasses

import pytest

from tokenmill.params import SamplingParams


def test_defaults_are_valid_and_not_greedy() -> None:
    params = SamplingParams()
    assert params.n == 1 and params.max_tokens == 16 and not params.greedy


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-7, True), (0.7, False)])
def test_greedy_follows_temperature(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=None), dict(max_tokens=1, min_tokens=1), dict(top_k=0), dict(top_k=1),
    dict(top_p=1.0), dict(min_p=1.0), dict(presence_penalty=-2.0, frequency_penalty=2.0),
    dict(logit_bias={5: -100.0, 7: 100}), dict(seed=0), dict(logprobs=0), dict(logprobs=20),
    dict(stop=["\n\n"], stop_token_ids=[0, 13]),
])
def test_valid_edge_values(kwargs: dict) -> None:
    SamplingParams(**kwargs)


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", True), ("max_tokens", 0), ("max_tokens", 2.5), ("min_tokens", -1),
    ("temperature", -0.1), ("temperature", float("nan")), ("top_k", -2), ("top_p", 0.0),
    ("top_p", 1.5), ("min_p", -0.1), ("min_p", 1.1), ("repetition_penalty", 0.0),
    ("presence_penalty", 2.1), ("frequency_penalty", -2.1), ("logit_bias", {1: 100.5}),
    ("logit_bias", {-1: 0.0}), ("seed", 1.5), ("stop", [""]), ("stop_token_ids", [-1]),
    ("logprobs", 21), ("logprobs", -1),
])
def test_invalid_value_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_cannot_exceed_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    SamplingParams(max_tokens=None, min_tokens=4)


def test_immutable_including_collections() -> None:
    bias = {1: 2.0}
    stop = ["x"]
    params = SamplingParams(logit_bias=bias, stop=stop, stop_token_ids=[3])
    bias[9] = 1.0
    stop.append("y")
    assert dict(params.logit_bias) == {1: 2.0} and params.stop == ("x",)
    assert params.stop_token_ids == (3,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        params.logit_bias[2] = 1.0  # type: ignore[index]


def test_equal_params_compare_and_hash_equal() -> None:
    a = SamplingParams(stop=["x"], logit_bias={1: 1.0})
    b = SamplingParams(stop=("x",), logit_bias={1: 1.0})
    assert a == b and hash(a) == hash(b)

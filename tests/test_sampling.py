"""Sampling-parameter normalization and validation (OpenAI and SGLang-native)."""

from __future__ import annotations

from typing import Any

import pytest

from smgd.errors import InvalidRequest
from smgd.sampling import MAX_N, for_choice, from_native, from_openai
from smgd.wire.common import SamplingParams

CTX = {"prompt_len": 10, "context_len": 100, "vocab_size": 1024, "eos_token_ids": (2, 5)}


def chat(body: dict[str, Any], **kw: Any) -> Any:
    return from_openai(body, chat=True, **{**CTX, **kw})


def completion(body: dict[str, Any], **kw: Any) -> Any:
    return from_openai(body, chat=False, **{**CTX, **kw})


def rejected(body: dict[str, Any], *, is_chat: bool = True) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        from_openai(body, chat=is_chat, **CTX)  # type: ignore[arg-type]
    return info.value


def test_defaults() -> None:
    params, opts = chat({"model": "m", "messages": []})
    assert params == SamplingParams(max_tokens=90, eos_token_ids=(2, 5))
    assert opts.stop == ()
    assert opts.n == 1
    assert opts.skip_special_tokens
    assert opts.ignored == ()


def test_full_openai_body() -> None:
    params, opts = chat(
        {
            "max_completion_tokens": 20,
            "max_tokens": 99,  # deprecated name loses to max_completion_tokens
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 40,
            "min_p": 0.1,
            "frequency_penalty": -1.5,
            "presence_penalty": 2,
            "repetition_penalty": 1.1,
            "seed": -7,
            "min_tokens": 3,
            "stop": ["\n\n", "User:", "\n\n"],
            "stop_token_ids": [7],
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 5,
            "logit_bias": {"17": -100, "3": 2.5},
            "n": 1,  # greedy: more would be a 400
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "response_format": {"type": "text"},
            "tool_choice": "auto",
        }
    )
    assert params.max_tokens == 20
    assert params.greedy
    assert (params.top_p, params.top_k, params.min_p) == (0.5, 40, 0.1)
    assert (params.frequency_penalty, params.presence_penalty) == (-1.5, 2.0)
    assert params.repetition_penalty == 1.1
    assert (params.seed, params.min_tokens, params.stop_token_ids) == (-7, 3, (7,))
    assert params.ignore_eos
    assert params.logprobs == 5
    assert params.logit_bias == {17: -100.0, 3: 2.5}
    assert opts.stop == ("\n\n", "User:")
    assert (opts.n, opts.include_stop_str_in_output, opts.skip_special_tokens) == (1, True, False)


def test_chat_logprobs_forms() -> None:
    assert chat({"logprobs": True})[0].logprobs == 0
    assert chat({"logprobs": False})[0].logprobs is None
    assert rejected({"top_logprobs": 2}).param == "top_logprobs"
    assert rejected({"logprobs": 3}).param == "logprobs"


def test_completion_logprobs_and_echo() -> None:
    params, opts = completion({"logprobs": 3, "echo": True, "stop": "END"})
    assert params.logprobs == 3
    assert opts.echo
    assert opts.stop == ("END",)
    assert rejected({"logprobs": 21}, is_chat=False).param == "logprobs"
    assert rejected({"logprobs": True}, is_chat=False).param == "logprobs"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.01),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "hot"),
        ("temperature", True),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", 1.1),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3),
        ("repetition_penalty", 0),
        ("repetition_penalty", 2.1),
        ("n", 0),
        ("n", MAX_N + 1),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("max_tokens", 0),
        ("max_tokens", 5.0),
        ("min_tokens", -1),
        ("stop", [""]),
        ("stop", ["a"] * 33),
        ("stop", 5),
        ("stop_token_ids", [1024]),
        ("stop_token_ids", [-1]),
        ("logit_bias", {"1024": 1}),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"1": 101}),
        ("logit_bias", {"1": "a"}),
        ("ignore_eos", "yes"),
        ("top_logprobs", 21),
    ],
)
def test_out_of_range_names_the_param(key: str, value: object) -> None:
    body: dict[str, Any] = {key: value}
    if key == "top_logprobs":
        body["logprobs"] = True
    err = rejected(body)
    assert err.param == key
    assert err.status == 400


def test_edges_are_accepted() -> None:
    params, opts = chat(
        {
            "temperature": 2,
            "top_p": 1,
            "min_p": 0,
            "frequency_penalty": -2,
            "repetition_penalty": 2,
            "n": MAX_N,
            "seed": 2**63 - 1,
            "stop": ["s"] * 32,
            "logit_bias": {"1023": 100, "0": -100},
        }
    )
    assert params.temperature == 2.0
    assert opts.n == MAX_N
    assert params.seed == 2**63 - 1


def test_top_k_off_spellings() -> None:
    assert chat({"top_k": 0})[0].top_k == -1
    assert chat({"top_k": -1})[0].top_k == -1
    assert chat({"top_k": 5000})[0].top_k == -1  # beyond the vocab: no cut
    assert chat({"top_k": 1})[0].top_k == 1


def test_max_tokens_must_fit_context() -> None:
    assert chat({"max_tokens": 90})[0].max_tokens == 90
    err = rejected({"max_tokens": 91})
    assert err.param == "max_tokens"
    assert err.code == "context_length_exceeded"
    assert "maximum context length is 100 tokens" in err.message
    assert "101 tokens (10 in the messages, 91 in the completion)" in err.message
    assert rejected({"max_completion_tokens": 500}).param == "max_completion_tokens"


def test_prompt_filling_context_is_rejected() -> None:
    with pytest.raises(InvalidRequest) as info:
        completion({}, prompt_len=100)
    assert info.value.param == "prompt"
    assert "your prompt resulted in 100 tokens" in info.value.message


def test_min_tokens_above_max_tokens() -> None:
    err = rejected({"max_tokens": 5, "min_tokens": 6})
    assert err.param == "min_tokens"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"best_of": 3}, "best_of"),
        ({"suffix": "tail"}, "suffix"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.name",
        ),
        ({"guided_json": {}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"prediction": {"type": "content"}}, "prediction"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"functions": [{"name": "f"}]}, "functions"),
        # vLLM's: keep the prompt's last k tokens. It was ignored: the whole prompt ran.
        ({"truncate_prompt_tokens": 10}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -1}, "truncate_prompt_tokens"),
    ],
)
def test_unsupported_features_are_named(body: dict[str, Any], param: str) -> None:
    err = rejected(body)
    assert err.param == param


def test_harmless_forms_of_unsupported_features() -> None:
    params, opts = completion(
        {"best_of": 2, "n": 2, "suffix": "", "guided_json": None, "truncate_prompt_tokens": None}
    )
    assert opts.n == 2
    assert params.max_tokens == 90


def test_unknown_keys_are_reported_not_fatal() -> None:
    _, opts = chat({"model": "m", "stream": True, "user": "u", "frobnicate": 1, "verbosity": "x"})
    assert opts.ignored == ("frobnicate", "verbosity")


def native(sp: dict[str, Any] | None, **kw: Any) -> Any:
    return from_native(sp, **{**CTX, **kw})


def test_native_defaults_follow_sglang() -> None:
    params, opts = native(None)
    assert params.max_tokens == 90  # SGLang's 128, clamped to the room left
    assert native({}, context_len=1000)[0].max_tokens == 128
    assert opts.n == 1
    assert not opts.include_stop_str_in_output


def test_native_params() -> None:
    params, opts = native(
        {
            "max_new_tokens": 8,
            "min_new_tokens": 2,
            "stop": "x",
            "stop_token_ids": [9],
            "temperature": 0.7,
            "top_k": 20,
            "sampling_seed": 11,
            "no_stop_trim": True,
            "skip_special_tokens": False,
            "ignore_eos": True,
            "n": 3,
            "stream_interval": 4,
            "weird": 1,
        },
        logprobs=2,
    )
    assert (params.max_tokens, params.min_tokens, params.top_k, params.seed) == (8, 2, 20, 11)
    assert params.stop_token_ids == (9,)
    assert params.ignore_eos
    assert params.logprobs == 2
    assert opts.stop == ("x",)
    assert opts.include_stop_str_in_output
    assert opts.n == 3
    assert not opts.skip_special_tokens
    assert opts.ignored == ("weird",)
    assert native({"seed": 5})[0].seed == 5


@pytest.mark.parametrize(
    ("sp", "param"),
    [
        ({"max_new_tokens": 91}, "sampling_params.max_new_tokens"),
        ({"temperature": -1}, "sampling_params.temperature"),
        ({"min_new_tokens": 50, "max_new_tokens": 10}, "sampling_params.min_new_tokens"),
        ({"regex": "a+", "json_schema": "{}"}, "sampling_params.regex"),
        ({"json_schema": "[]"}, "sampling_params.json_schema"),
        ({"structural_tag": "{}"}, "sampling_params.structural_tag"),
        ({"n": 17}, "sampling_params.n"),
    ],
)
def test_native_rejections(sp: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        native(sp)
    assert info.value.param == param


def test_native_logprobs_range_and_shape() -> None:
    with pytest.raises(InvalidRequest) as info:
        native({}, logprobs=21)
    assert info.value.param == "top_logprobs_num"
    with pytest.raises(InvalidRequest):
        native([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [0, 0.0, 9e-6])
@pytest.mark.parametrize("is_chat", [True, False])
def test_n_above_1_with_greedy_sampling_is_refused(temperature: float, is_chat: bool) -> None:
    err = rejected({"n": 3, "temperature": temperature}, is_chat=is_chat)
    assert err.param == "n"
    assert err.message == "n must be 1 when using greedy sampling, got 3."


def test_n_above_1_is_fine_when_sampling() -> None:
    assert chat({"n": 2, "temperature": 1e-5})[1].n == 2  # vLLM's bound: below 1e-5 is greedy
    assert chat({"n": 2})[1].n == 2  # the default temperature is 1
    assert chat({"n": 1, "temperature": 0})[1].n == 1


def test_each_choice_gets_seed_plus_its_index() -> None:
    params = chat({"n": 3, "seed": 41})[0]
    assert [for_choice(params, j).seed for j in range(3)] == [41, 42, 43]
    assert for_choice(params, 0) is params
    unseeded = chat({"n": 3})[0]
    assert for_choice(unseeded, 2) is unseeded
    no_seed = chat({"n": 3, "seed": -1})[0]  # vLLM's "no seed"
    assert for_choice(no_seed, 2).seed == -1
    top = chat({"n": 2, "seed": 2**63 - 1})[0]  # wraps within a signed 64-bit integer
    assert for_choice(top, 1).seed == -(2**63)
    assert for_choice(top, 1).max_tokens == top.max_tokens


def test_prompt_logprobs_echo_and_priority() -> None:
    params, opts = completion({"prompt_logprobs": 3, "priority": -4})
    assert params.prompt_logprobs == 3 and opts.priority == -4
    # vLLM: echo with logprobs brings the prompt's logprobs, with the same k
    params, opts = completion({"echo": True, "logprobs": 2})
    assert params.prompt_logprobs == 2 and params.logprobs == 2 and opts.echo
    params, opts = completion({"echo": True, "logprobs": 1, "max_tokens": 0})
    assert opts.echo_only and params.max_tokens == 1
    params, opts = completion({"logprobs": 20})
    assert params.logprobs == 20 and params.prompt_logprobs is None and opts.priority is None


# One valid value per field both APIs spell the same, and the field it sets.
_NAMED = {
    "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "frequency_penalty": 0.5,
    "presence_penalty": -0.5, "repetition_penalty": 1.1, "stop_token_ids": [7, 8],
    "ignore_eos": True, "logit_bias": {"3": 1.5}, "seed": 11, "min_tokens": 2,
}  # fmt: skip


@pytest.mark.parametrize("null", [False, True])
@pytest.mark.parametrize("named", [(), ("temperature",), ("top_k", "logit_bias"), tuple(_NAMED)])
def test_a_field_not_named_gets_the_default_whatever_else_is_named(
    named: tuple[str, ...], null: bool
) -> None:
    """Only the keys a request names are read: each other field must come out as it would
    for an absent key, SamplingParams' default, and the named ones as given."""
    body: dict[str, Any] = {k: _NAMED[k] for k in named}
    if null:  # a null key is an absent one
        body.update({k: None for k in _NAMED if k not in named})
    sp = {("min_new_tokens" if k == "min_tokens" else k): v for k, v in body.items()}
    for params in (completion(body)[0], native({**sp, "max_new_tokens": 5})[0]):
        default = SamplingParams(max_tokens=params.max_tokens, eos_token_ids=(2, 5))
        for field, value in _NAMED.items():
            if field not in named:
                value = getattr(default, field)
            elif field == "stop_token_ids":
                value = (7, 8)
            elif field == "logit_bias":
                value = {3: 1.5}
            assert getattr(params, field) == value, field


def test_with_two_bad_fields_the_400_names_the_first_in_a_fixed_order() -> None:
    body = {"logit_bias": "x", "top_p": 7, "temperature": -1, "min_p": 9}
    assert rejected(body).param == "temperature"
    assert rejected({"logit_bias": "x", "min_p": 9}).param == "min_p"


_OPTION_KEYS = (
    "n", "echo", "stop", "include_stop_str_in_output", "skip_special_tokens", "priority",
    "logprobs", "top_logprobs", "prompt_logprobs", "spaces_between_special_tokens",
)  # fmt: skip


@pytest.mark.parametrize("endpoint", [chat, completion])
def test_options_not_named_and_options_null_read_the_same(endpoint: Any) -> None:
    """The keys a request leaves out are not read at all: the result must be what reading
    them as null gives."""
    absent = endpoint({"max_tokens": 5})
    null = endpoint({"max_tokens": 5, **dict.fromkeys(_OPTION_KEYS)})
    assert absent == null
    assert absent[1].n == 1 and absent[1].skip_special_tokens and absent[1].stop == ()

"""Request sampling parameters → one normalized, validated form.

Two inputs: OpenAI bodies (``/v1/chat/completions``, ``/v1/completions``, including the vLLM
extensions clients commonly send: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, ``include_stop_str_in_output``)
and SGLang-native ``sampling_params`` (``/generate``). One output: the engine part,
:class:`smgd.wire.common.SamplingParams`, and the smgd-side text part, :class:`TextOptions`
(stop strings never reach an engine; smgd matches them on the detokenized text).

Every rejection is ``InvalidRequest`` (400) naming the offending ``param``. Policy:

- ``n > 1`` with greedy sampling (temperature below 1e-5) is a 400 naming ``n``, as vLLM
  answers (the choices would all be the same); with a ``seed``, choice ``j`` gets the seed
  ``seed + j`` (:func:`for_choice`), as vLLM gives it, so the choices differ and each one is
  reproducible.
- ``max_tokens`` (chat: ``max_completion_tokens`` first) defaults to the room left in the
  context; asking for more than that is a 400 like OpenAI's (code
  ``context_length_exceeded``). Native ``max_new_tokens`` defaults to SGLang's 128.
- Structured output (constrained decoding by the engine's grammar backend) is accepted in every
  spelling clients send and normalized into one :class:`smgd.wire.common.Structured`: OpenAI's
  ``response_format`` (``text``, ``json_object``, ``json_schema``), vLLM's ``structured_outputs``
  (``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` and its whitespace options) and
  its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` /
  ``guided_whitespace_pattern``, and SGLang-native ``json_schema`` / ``regex`` / ``ebnf``. At
  most one constraint per request (a 400 naming both otherwise); a schema that is not JSON, not
  an object, or nested deeper than :data:`MAX_SCHEMA_NESTING` is a 400 naming its param, as are
  the inputs vLLM's front end refuses because they can crash an engine (an empty grammar, a NUL
  in a regex, an empty choice list). Whether the engine can apply it is the engine client's
  business (``smgd.engines``).
- Features that need a parser or a mode smgd does not have are rejected by name rather than
  silently ignored: ``best_of`` (other than 1 / ``n``), ``suffix``, a ``structural_tag``,
  predicted outputs, non-text modalities, and SGLang's structural_tag / stop_regex /
  custom_params.
- Logprobs: completions ``logprobs`` and chat ``top_logprobs`` up to :data:`MAX_LOGPROBS`
  (vLLM's limit). ``prompt_logprobs`` (vLLM's extension) asks for the prompt tokens' logprobs;
  completions ``echo`` with ``logprobs`` implies it, as in vLLM, and ``echo`` may come with
  ``max_tokens: 0`` (the reply is then the prompt alone: :attr:`TextOptions.echo_only`).
- ``priority`` (vLLM's and SGLang's extension) is read and range-checked here; whether the
  engine schedules by it is the API layer's check (``[[engines]] scheduling``).
- ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are the chat endpoint's business
  (``smgd.api.core.tools``: it validates them, and gives ``required`` / a named function
  their constraint); the chat template renders the tools.
- Keys nobody here knows are ignored, as vLLM does (OpenAI adds fields faster than servers
  follow), and listed in ``TextOptions.ignored`` so the API layer can log them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from smgd.errors import InvalidRequest
from smgd.wire.common import SamplingParams, Structured, StructuredKind

__all__ = [
    "MAX_N",
    "MAX_PRIORITY",
    "MAX_SCHEMA_NESTING",
    "MAX_STOPS",
    "MIN_PRIORITY",
    "TRUNCATION_UNSUPPORTED",
    "TextOptions",
    "check_nesting",
    "for_choice",
    "for_prompt",
    "from_native",
    "from_openai",
    "nested_deeper",
    "read_priority",
]

# `n` fans one HTTP request out into n engine requests while admission counts one; 16 keeps a
# single caller from filling a decode batch (OpenAI allows 128, but its fleet is larger).
MAX_N = 16
# Every stop string is searched on every text delta; 32 bounds that per-token cost (OpenAI
# allows 4; vLLM has no limit).
MAX_STOPS = 32
# vLLM's default max_logprobs: top-k logprobs cost a sort per token per request on the engine.
MAX_LOGPROBS = 20
# The legacy completions `logprobs` limit: vLLM's (its max_logprobs, as for chat's
# `top_logprobs`), not OpenAI's 5, so clients written for vLLM (lm-eval) get what they ask for.
MAX_COMPLETION_LOGPROBS = MAX_LOGPROBS
# Scheduling priorities: 32-bit, far more levels than any policy needs, and clear of the
# sys.maxsize sentinels SGLang gives requests without one.
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1
# SGLang's own SamplingParams default, so native clients get what SGLang itself would give.
NATIVE_DEFAULT_MAX_NEW_TOKENS = 128
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# vLLM's _SAMPLING_EPS: a temperature below it is greedy sampling.
GREEDY_TEMPERATURE = 1e-5
# vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING: objects and arrays nested deeper than this can
# exhaust a grammar backend's recursion while it walks the schema, on any engine.
MAX_SCHEMA_NESTING = 64

# vLLM's older names for a structured_outputs field (vLLM 0.32 dropped them; clients still send
# them) -> that field. guided_decoding_backend is not here: the backend is the engine's (see
# smgd.toml [engines.structured_output]), so it is reported as ignored.
_GUIDED = {
    "guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
    "guided_grammar": "grammar",
}  # fmt: skip
# Keys the API layer consumes (or that are pure bookkeeping); neither sampling nor "ignored".
_OPENAI_API_KEYS = frozenset(
    {
        "model", "messages", "prompt", "stream", "stream_options", "tools", "parallel_tool_calls",
        "chat_template", "chat_template_kwargs", "add_generation_prompt", "add_special_tokens",
        "continue_final_message", "documents", "request_id", "user", "metadata", "store",
        "service_tier", "truncate_prompt_tokens", "include_reasoning",
    }
)  # fmt: skip
_OPENAI_SAMPLING_KEYS = frozenset(
    {
        "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "seed", "min_tokens",
        "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "logit_bias", "n",
        "echo", "skip_special_tokens", "include_stop_str_in_output", "best_of", "suffix",
        "response_format", "tool_choice", "spaces_between_special_tokens",
        "structured_outputs", *_GUIDED, "guided_whitespace_pattern", "prompt_logprobs",
        "priority",
    }
)  # fmt: skip
# Present and not null → 400, whatever the value.
_OPENAI_UNSUPPORTED = ("prediction", "audio", "functions", "function_call")
_NATIVE_KEYS = frozenset(
    {
        "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "temperature", "top_p",
        "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
        "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
        "n", "sampling_seed", "seed", "logit_bias", "stream_interval", "json_schema", "regex",
        "ebnf",
    }
)  # fmt: skip
_NATIVE_UNSUPPORTED = ("structural_tag", "stop_regex", "custom_params")


class TextOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The smgd-side half of a request's options (text handling, fan-out)."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    echo: bool = False
    # Completions `echo` with `max_tokens: 0` (vLLM's "echo without generation"): the engine
    # makes one token for the prompt's logprobs; the reply has the prompt alone.
    echo_only: bool = False
    priority: int | None = None  # the request's scheduling priority, if it gave one
    ignored: tuple[str, ...] = ()  # request keys that had no effect (for a log line)


class _Reader:
    """Typed, range-checked access to one request dict; errors name the param."""

    def __init__(self, body: Mapping[str, Any], prefix: str = "") -> None:
        self.body = body
        self.prefix = prefix

    def fail(self, key: str, message: str) -> InvalidRequest:
        return InvalidRequest(message, param=self.prefix + key)

    def number(
        self,
        key: str,
        default: float,
        lo: float,
        hi: float,
        *,
        lo_open: bool = False,
    ) -> float:
        value = self.body.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"`{key}` must be a number")
        if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
            bracket = "(" if lo_open else "["
            raise self.fail(key, f"`{key}` must be in {bracket}{lo:g}, {hi:g}], got {value!r}")
        return float(value)

    def integer(self, key: str, default: int | None, lo: int, hi: int | None) -> int | None:
        value = self.body.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"`{key}` must be an integer")
        if value < lo or (hi is not None and value > hi):
            upper = "" if hi is None else f" and <= {hi}"
            raise self.fail(key, f"`{key}` must be >= {lo}{upper}, got {value}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.body.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(key, f"`{key}` must be a boolean")
        return value

    def stops(self, key: str) -> tuple[str, ...]:
        value = self.body.get(key)
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise self.fail(key, f"`{key}` must be a string or an array of strings")
        if len(items) > MAX_STOPS:
            raise self.fail(key, f"at most {MAX_STOPS} stop sequences are allowed")
        if any(not s for s in items):
            raise self.fail(key, "stop sequences must be non-empty strings")
        return tuple(dict.fromkeys(items))

    def token_ids(self, key: str, vocab_size: int) -> tuple[int, ...]:
        value = self.body.get(key)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size for v in value
        ):
            raise self.fail(key, f"`{key}` must be an array of token ids in [0, {vocab_size})")
        return tuple(dict.fromkeys(value))  # a set: at most the vocabulary goes to the engine

    def logit_bias(self, key: str, vocab_size: int) -> dict[int, float] | None:
        value = self.body.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.fail(key, f"`{key}` must be an object of token id -> bias")
        out: dict[int, float] = {}
        for raw_id, bias in value.items():
            try:
                token_id = int(raw_id)
            except (TypeError, ValueError):
                raise self.fail(key, f"`{key}` key {raw_id!r} is not a token id") from None
            if not 0 <= token_id < vocab_size:
                raise self.fail(key, f"`{key}` token id {token_id} not in [0, {vocab_size})")
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise self.fail(key, f"`{key}` values must be numbers")
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise self.fail(key, f"`{key}` values must be in [-100, 100], got {bias!r}")
            out[token_id] = float(bias)
        return out or None

    def top_k(self, key: str, vocab_size: int) -> int:
        value = self.integer(key, -1, -1, None)
        assert value is not None
        # vLLM also takes 0 as "off"; a cut at or above the vocab is no cut either.
        return -1 if value in (0, -1) or value >= vocab_size else value

    def seed(self, key: str) -> int | None:
        return self.integer(key, None, _INT64_MIN, _INT64_MAX)

    def reject_present(self, keys: Sequence[str], why: str) -> None:
        for key in keys:
            if self.body.get(key) is not None:
                raise self.fail(key, f"`{key}` is not supported by smgd ({why})")


# ------------------------------------------------------------------------- structured output


def nested_deeper(value: Any, limit: int) -> bool:
    """Whether ``value`` (decoded JSON) nests arrays/objects more than ``limit`` levels: a
    request body's (smgd.api.core.prepare) and a schema's (:func:`check_nesting`).

    Level by level (no recursion), with exact type tests (decoded JSON has no subclasses)
    rather than isinstance: 3x faster than a stack of (item, depth) pairs on bodies of many
    small containers, 4x on long arrays of numbers (a 7 MB schema of 600,000 small arrays
    took 0.6 s to walk on the event loop; 2.1 s -> 0.64 s for such a body)."""
    level = [value]
    for _ in range(limit):
        level = [
            child
            for node in level
            for child in (node.values() if type(node) is dict else node)
            if type(child) is dict or type(child) is list
        ]
        if not level:
            return False
    return True


def _too_deep(value: Any) -> bool:
    """Whether a schema nests deeper than MAX_SCHEMA_NESTING."""
    return nested_deeper(value, MAX_SCHEMA_NESTING)


def _schema(value: Any, param: str, *, text_ok: bool = True) -> dict[str, Any] | str:
    """A JSON schema given as an object (or, where ``text_ok``, as JSON text), checked."""
    parsed = value
    if isinstance(value, str) and text_ok:
        if not value.strip():
            raise InvalidRequest(
                f"`{param}` must be a JSON schema, got an empty string", param=param
            )
        try:
            parsed = msgspec.json.decode(value)
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"`{param}` is not valid JSON: {exc}", param=param) from None
    if not isinstance(parsed, dict):
        what = "a JSON schema object" if text_ok else "an object (the JSON schema)"
        raise InvalidRequest(f"`{param}` must be {what}", param=param)
    check_nesting(parsed, param)
    return value if isinstance(value, str) else parsed


def check_nesting(schema: dict[str, Any], param: str, *, within: str = "") -> None:
    """Refuse (400 naming ``param``) a schema whose objects and arrays nest deeper than
    :data:`MAX_SCHEMA_NESTING`; ``within``: what the limit counts, when more than ``param``."""
    if _too_deep(schema):
        raise InvalidRequest(
            f"`{param}` is nested too deeply: objects and arrays may nest at most "
            f"{MAX_SCHEMA_NESTING} levels{within}",
            param=param,
        )


def _text(value: Any, param: str, *, what: str, empty_ok: bool) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"`{param}` must be a string ({what})", param=param)
    if not empty_ok and not value.strip():
        raise InvalidRequest(f"`{param}` must be a non-empty {what}", param=param)
    if "\x00" in value:  # xgrammar's native converters do not handle NUL (vLLM refuses it too)
        raise InvalidRequest(f"`{param}` must not contain a NUL character", param=param)
    return value


def _choices(value: Any, param: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise InvalidRequest(
            f"`{param}` must be a non-empty array of non-empty strings", param=param
        )
    if any("\x00" in c for c in value):
        raise InvalidRequest(f"`{param}` must not contain a NUL character", param=param)
    return tuple(value)


def _constraint(field: str, value: Any, param: str) -> Structured:
    """One vLLM-style constraint field (``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``) or SGLang's (``json_schema``, ``regex``, ``ebnf``) -> Structured."""
    if field in ("json", "json_schema"):
        return Structured(kind=StructuredKind.JSON, param=param, spec=_schema(value, param))
    if field == "regex":
        spec = _text(value, param, what="regular expression", empty_ok=True)
        return Structured(kind=StructuredKind.REGEX, param=param, spec=spec)
    if field in ("grammar", "ebnf"):
        spec = _text(value, param, what="EBNF grammar", empty_ok=False)
        return Structured(kind=StructuredKind.GRAMMAR, param=param, spec=spec)
    if field == "choice":
        return Structured(kind=StructuredKind.CHOICE, param=param, choices=_choices(value, param))
    assert field == "json_object"
    if value is not True:
        raise InvalidRequest(
            f"`{param}` must be true if set (omit it for unconstrained output)", param=param
        )
    return Structured(kind=StructuredKind.JSON_OBJECT, param=param)


# structured_outputs fields: the constraints (at most one), then vLLM's options for them.
_SO_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
_SO_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


def _response_format(value: Any) -> Structured | None:
    if not isinstance(value, dict):
        raise InvalidRequest("`response_format` must be an object", param="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured(kind=StructuredKind.JSON_OBJECT, param="response_format")
    if kind != "json_schema":
        raise InvalidRequest(
            f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
            param="response_format.type",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(
            "response_format type 'json_schema' needs a `json_schema` object",
            param="response_format.json_schema",
        )
    r = _Reader(spec, prefix="response_format.json_schema.")
    if not isinstance(spec.get("name"), str):
        raise r.fail("name", "`name` is required and must be a string")
    r.flag("strict", False)  # constrained either way, as vLLM does; checked for its type only
    if not isinstance(spec.get("description", ""), str | None):
        raise r.fail("description", "`description` must be a string")
    if spec.get("schema") is None:
        raise r.fail("schema", "`schema` is required (the JSON schema of the response)")
    schema = _schema(spec["schema"], "response_format.json_schema.schema", text_ok=False)
    return Structured(kind=StructuredKind.JSON, param="response_format", spec=schema)


# Every key _structured_openai reads.
_STRUCTURED_OPENAI_KEYS = frozenset(
    {"response_format", "structured_outputs", *_GUIDED, "guided_whitespace_pattern"}
)


def _structured_openai(body: Mapping[str, Any], ignored: list[str]) -> Structured | None:
    """The request's one constraint from every OpenAI/vLLM spelling, or None.

    ``structured_outputs`` fields nobody here knows are appended to ``ignored`` (vLLM ignores
    them too).
    """
    if _STRUCTURED_OPENAI_KEYS.isdisjoint(body):
        return None  # nearly every request: none of the seven keys to look at
    found: list[Structured] = []
    fmt = body.get("response_format")
    if fmt is not None and (rf := _response_format(fmt)) is not None:
        found.append(rf)
    options: dict[str, Any] = {}
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequest(
                "`structured_outputs` must be an object", param="structured_outputs"
            )
        for key, value in so.items():
            param = f"structured_outputs.{key}"
            if value is None:
                continue
            if key in _SO_CONSTRAINTS:
                found.append(_constraint(key, value, param))
            elif key in _SO_OPTIONS:
                options[key] = value
            elif key == "structural_tag":
                raise InvalidRequest("`structural_tag` is not supported by smgd", param=param)
            else:
                ignored.append(param)
    for key, field in _GUIDED.items():
        if body.get(key) is not None:
            found.append(_constraint(field, body[key], key))
    if body.get("guided_whitespace_pattern") is not None:
        options.setdefault("whitespace_pattern", body["guided_whitespace_pattern"])
    if len(found) > 1:
        first, second = found[0].param, found[1].param
        raise InvalidRequest(
            f"only one structured output constraint is allowed per request, got `{first}` and "
            f"`{second}`",
            param=second,
        )
    if not found:
        if options:  # vLLM answers the same: options without a constraint
            named = so is not None and any(so.get(key) is not None for key in _SO_OPTIONS)
            where = "structured_outputs" if named else "guided_whitespace_pattern"
            raise InvalidRequest(
                f"`{where}` has options but no constraint (json, regex, choice, grammar or "
                "json_object)",
                param=where,
            )
        return None
    opts = _Reader(options, prefix="structured_outputs.")
    pattern = options.get("whitespace_pattern")
    if pattern is not None:
        where = "structured_outputs.whitespace_pattern"
        if "whitespace_pattern" not in (so or {}):
            where = "guided_whitespace_pattern"
        pattern = _text(pattern, where, what="regular expression", empty_ok=True)
    return msgspec.structs.replace(
        found[0],
        disable_any_whitespace=opts.flag("disable_any_whitespace", False),
        disable_additional_properties=opts.flag("disable_additional_properties", False),
        whitespace_pattern=pattern,
    )


def _structured_native(body: Mapping[str, Any]) -> Structured | None:
    found = [
        _constraint(key, body[key], f"sampling_params.{key}")
        for key in ("json_schema", "regex", "ebnf")
        if body.get(key) is not None
    ]
    if len(found) > 1:
        raise InvalidRequest(
            f"only one of json_schema, regex and ebnf is allowed, got `{found[0].param}` and "
            f"`{found[1].param}`",
            param=found[1].param,
        )
    return found[0] if found else None


def _context_error(ctx: int, prompt_len: int, what: str, param: str) -> InvalidRequest:
    return InvalidRequest(
        f"This model's maximum context length is {ctx} tokens. However, your {what} resulted "
        f"in {prompt_len} tokens. Please reduce the length of the {what}.",
        param=param,
        code="context_length_exceeded",
    )


def _max_tokens(
    requested: int | None, *, key: str, prompt_len: int, context_len: int, what: str
) -> int:
    room = context_len - prompt_len
    if room < 1:  # at least one token must be generated
        raise _context_error(context_len, prompt_len, what, what)
    if requested is None:
        return room
    if requested > room:
        raise InvalidRequest(
            f"This model's maximum context length is {context_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the {what}, "
            f"{requested} in the completion). Please reduce the length of the {what} or "
            "completion.",
            param=key,
            code="context_length_exceeded",
        )
    return requested


def _common(
    r: _Reader,
    *,
    max_tokens: int,
    min_key: str,
    seed_key: str,
    vocab_size: int,
    eos_token_ids: Sequence[int],
    logprobs: int | None,
) -> SamplingParams:
    body = r.body
    min_tokens = (r.integer(min_key, 0, 0, None) or 0) if min_key in body else 0
    _check_min_tokens(r, min_key, min_tokens, max_tokens)
    fields: dict[str, Any] = {}
    if seed_key in body:
        fields["seed"] = r.seed(seed_key)
    # Only the keys the request names are read, in this fixed order (the first bad one is
    # the one a 400 names); the rest keep SamplingParams' defaults, which are what each
    # reader gives an absent key. A request names a few of these; reading all ten was ten
    # calls per request.
    for key, read in _COMMON_READERS.items():
        if key in body:
            fields[key] = read(r, key, vocab_size)
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        eos_token_ids=tuple(eos_token_ids),
        logprobs=logprobs,
        **fields,
    )


# The sampling fields both APIs spell the same, each with its reader: (reader, key, vocabulary
# size) -> the field's value, SamplingParams' default when the key is null.
_COMMON_READERS: dict[str, Callable[[_Reader, str, int], Any]] = {
    "temperature": lambda r, key, _: r.number(key, 1.0, 0.0, 2.0),
    "top_p": lambda r, key, _: r.number(key, 1.0, 0.0, 1.0, lo_open=True),
    "top_k": lambda r, key, vocab_size: r.top_k(key, vocab_size),
    "min_p": lambda r, key, _: r.number(key, 0.0, 0.0, 1.0),
    "frequency_penalty": lambda r, key, _: r.number(key, 0.0, -2.0, 2.0),
    "presence_penalty": lambda r, key, _: r.number(key, 0.0, -2.0, 2.0),
    "repetition_penalty": lambda r, key, _: r.number(key, 1.0, 0.0, 2.0, lo_open=True),
    "stop_token_ids": lambda r, key, vocab_size: r.token_ids(key, vocab_size),
    "ignore_eos": lambda r, key, _: r.flag(key, False),
    "logit_bias": lambda r, key, vocab_size: r.logit_bias(key, vocab_size),
}


# The keys _openai_logprobs reads (either API).
_LOGPROBS_KEYS = frozenset({"logprobs", "top_logprobs"})


def _openai_logprobs(r: _Reader, chat: bool) -> int | None:
    if not chat:  # completions: `logprobs` is the number of top alternatives
        return r.integer("logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    wanted = r.flag("logprobs", False)
    top = r.integer("top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not wanted:
        raise r.fail("top_logprobs", "`top_logprobs` requires `logprobs` to be true")
    return (top or 0) if wanted else None


# The keys _openai_features checks: a request without any of them (nearly every one) skips it.
_OPENAI_FEATURE_KEYS = frozenset(
    {*_OPENAI_UNSUPPORTED, "best_of", "suffix", "modalities", "truncate_prompt_tokens"}
)
# vLLM's prompt truncation (keep the last k tokens; -1: the context's worth). smgd never cuts a
# prompt: a prompt longer than the context is a 400, and one that fits runs whole.
TRUNCATION_UNSUPPORTED = "prompts are not truncated; one longer than the context is a 400"


def _openai_features(r: _Reader, n: int) -> None:
    body = r.body
    if _OPENAI_FEATURE_KEYS.isdisjoint(body):
        return
    r.reject_present(_OPENAI_UNSUPPORTED, "no predicted outputs, audio or function-call parsing")
    r.reject_present(("truncate_prompt_tokens",), TRUNCATION_UNSUPPORTED)
    best_of = r.integer("best_of", None, 1, None)
    if best_of is not None and best_of not in (1, n):
        raise r.fail("best_of", "`best_of` is not supported (only 1 or equal to `n`)")
    if body.get("suffix"):
        raise r.fail("suffix", "`suffix` is not supported")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise r.fail("modalities", "only the text modality is supported")


def _openai_max_tokens(
    r: _Reader, *, chat: bool, prompt_len: int, context_len: int
) -> tuple[int, bool]:
    """(max_tokens, echo_only) of an OpenAI body for a prompt of ``prompt_len`` tokens."""
    body = r.body
    key = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        key = "max_completion_tokens"  # the current name; max_tokens is deprecated for chat
    echo = r.flag("echo", False) if "echo" in body else False
    # vLLM's "echo without generation": completions `echo` may ask for no new tokens.
    requested = r.integer(key, None, 0 if echo and not chat else 1, None)
    echo_only = requested == 0
    max_tokens = _max_tokens(
        1 if echo_only else requested,
        key=key,
        prompt_len=prompt_len,
        context_len=context_len,
        what="messages" if chat else "prompt",
    )
    return max_tokens, echo_only


def for_prompt(
    body: Mapping[str, Any],
    params: SamplingParams,
    *,
    chat: bool,
    prompt_len: int,
    context_len: int,
) -> SamplingParams:
    """``params``, which :func:`from_openai` made for another prompt of the same ``body``, for a
    prompt of ``prompt_len`` tokens. Only ``max_tokens`` depends on the prompt (by default the
    room it leaves), so nothing else is read again: everything else costs what the body's
    size does, and a completions batch has up to 64 prompts (1,000,000 ``stop_token_ids`` were
    checked for each of them, 6.4 s)."""
    r = _Reader(body)
    max_tokens, _ = _openai_max_tokens(r, chat=chat, prompt_len=prompt_len, context_len=context_len)
    _check_min_tokens(r, "min_tokens", params.min_tokens, max_tokens)
    if max_tokens == params.max_tokens:
        return params
    return msgspec.structs.replace(params, max_tokens=max_tokens)


def _check_min_tokens(r: _Reader, key: str, min_tokens: int, max_tokens: int) -> None:
    if min_tokens > max_tokens:
        raise r.fail(key, f"`{key}` ({min_tokens}) exceeds the output limit {max_tokens}")


def from_openai(
    body: Mapping[str, Any],
    *,
    chat: bool,
    prompt_len: int,
    context_len: int,
    vocab_size: int,
    eos_token_ids: Sequence[int] = (),
) -> tuple[SamplingParams, TextOptions]:
    """Normalize an OpenAI chat/completions body (sampling part) after tokenizing the prompt.

    A key the request does not name is not read (``key in body`` first): most requests name a
    handful of the thirty-odd keys, and each read is a call. For the request's other prompts,
    :func:`for_prompt`.
    """
    r = _Reader(body)
    n = (r.integer("n", 1, 1, MAX_N) or 1) if "n" in body else 1
    _openai_features(r, n)
    echo = r.flag("echo", False) if "echo" in body else False
    max_tokens, echo_only = _openai_max_tokens(
        r, chat=chat, prompt_len=prompt_len, context_len=context_len
    )
    logprobs = _openai_logprobs(r, chat) if not _LOGPROBS_KEYS.isdisjoint(body) else None
    prompt_logprobs = (
        r.integer("prompt_logprobs", None, 0, MAX_LOGPROBS) if "prompt_logprobs" in body else None
    )
    if echo and not chat and prompt_logprobs is None:
        prompt_logprobs = logprobs  # vLLM: echoed prompt tokens come with their logprobs
    params = _common(
        r,
        max_tokens=max_tokens,
        min_key="min_tokens",
        seed_key="seed",
        vocab_size=vocab_size,
        eos_token_ids=eos_token_ids,
        logprobs=logprobs,
    )
    if prompt_logprobs is not None:
        params = msgspec.structs.replace(params, prompt_logprobs=prompt_logprobs)
    ignored = [k for k in body if k not in _OPENAI_SAMPLING_KEYS and k not in _OPENAI_API_KEYS]
    structured = _structured_openai(body, ignored)
    if structured is not None:
        params = msgspec.structs.replace(params, structured=structured)
    if n > 1 and params.temperature < GREEDY_TEMPERATURE:
        raise r.fail("n", f"n must be 1 when using greedy sampling, got {n}.")  # vLLM's words
    if "spaces_between_special_tokens" in body:
        r.flag("spaces_between_special_tokens", True)  # type-checked only; see module docstring
    options = TextOptions(
        stop=r.stops("stop") if "stop" in body else (),
        include_stop_str_in_output=(
            r.flag("include_stop_str_in_output", False)
            if "include_stop_str_in_output" in body
            else False
        ),
        skip_special_tokens=(
            r.flag("skip_special_tokens", True) if "skip_special_tokens" in body else True
        ),
        n=n,
        echo=echo,
        echo_only=echo_only,
        priority=read_priority(body) if "priority" in body else None,
        ignored=tuple(ignored),
    )
    return params, options


def from_native(
    sampling_params: Mapping[str, Any] | None,
    *,
    prompt_len: int,
    context_len: int,
    vocab_size: int,
    eos_token_ids: Sequence[int] = (),
    logprobs: int | None = None,
    prompt_logprobs: bool = False,
    priority: int | None = None,
) -> tuple[SamplingParams, TextOptions]:
    """Normalize SGLang-native ``sampling_params`` (``/generate``).

    ``logprobs`` comes from the request's top level in SGLang (``return_logprob`` and
    ``top_logprobs_num``): None for none, k for the sampled token plus top-k;
    ``prompt_logprobs`` (``logprob_start_len`` 0) asks for the prompt's too, with the same k;
    ``priority`` is the request's (:func:`read_priority`).
    """
    body = sampling_params or {}
    if not isinstance(body, Mapping):
        raise InvalidRequest("`sampling_params` must be an object", param="sampling_params")
    r = _Reader(body, prefix="sampling_params.")
    r.reject_present(_NATIVE_UNSUPPORTED, "no structural tags, stop regexes or custom params")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(
            f"`top_logprobs_num` must be in [0, {MAX_LOGPROBS}]", param="top_logprobs_num"
        )
    requested = r.integer("max_new_tokens", None, 1, None)
    if requested is None:
        # The default is SGLang's, clamped to the room left rather than an error: the
        # client did not ask for anything that does not fit.
        requested = max(1, min(NATIVE_DEFAULT_MAX_NEW_TOKENS, context_len - prompt_len))
    max_tokens = _max_tokens(
        requested,
        key="sampling_params.max_new_tokens",
        prompt_len=prompt_len,
        context_len=context_len,
        what="prompt",
    )
    seed_key = "sampling_seed" if body.get("sampling_seed") is not None else "seed"
    params = _common(
        r,
        max_tokens=max_tokens,
        min_key="min_new_tokens",
        seed_key=seed_key,
        vocab_size=vocab_size,
        eos_token_ids=eos_token_ids,
        logprobs=logprobs,
    )
    structured = _structured_native(body)
    if structured is not None:
        params = msgspec.structs.replace(params, structured=structured)
    if prompt_logprobs and logprobs is not None:
        params = msgspec.structs.replace(params, prompt_logprobs=logprobs)
    r.flag("spaces_between_special_tokens", True)
    options = TextOptions(
        priority=priority,
        stop=r.stops("stop"),
        include_stop_str_in_output=r.flag("no_stop_trim", False),
        skip_special_tokens=r.flag("skip_special_tokens", True),
        n=r.integer("n", 1, 1, MAX_N) or 1,
        ignored=tuple(k for k in body if k not in _NATIVE_KEYS),
    )
    return params, options


def read_priority(body: Mapping[str, Any]) -> int | None:
    """The request's ``priority`` (SGLang's /generate has it at the top level), checked."""
    return _Reader(body).integer("priority", None, MIN_PRIORITY, MAX_PRIORITY)


def for_choice(params: SamplingParams, j: int) -> SamplingParams:
    """The sampling of choice ``j`` of ``n``: with a seed, ``seed + j`` (vLLM's rule).

    The sum wraps around within a signed 64-bit integer (the range the engines take); -1 is
    "no seed" to vLLM, so it stays as it is.
    """
    seed = params.seed
    if j == 0 or seed is None or seed == -1:
        return params
    seed = (seed + j - _INT64_MIN) % 2**64 + _INT64_MIN
    return msgspec.structs.replace(params, seed=seed)

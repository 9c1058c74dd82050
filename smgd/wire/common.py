"""Engine-neutral request and output types (and the grammar-field spelling SGLang and TokenSpeed
share).

Each engine's wire package translates its engine's structs to and from them: its ``encode``
module builds engine requests from a :class:`GenerateRequest`, its ``decode`` module turns engine
outputs into :class:`TokenDelta` values. Sans-IO: no sockets, no trio.
"""

from __future__ import annotations

import enum
import json
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from collections.abc import Callable


class StructuredKind(enum.Enum):
    """What a structured-output constraint asks the engine's grammar backend for."""

    JSON = "json"  # text matching a JSON schema
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"
    CHOICE = "choice"  # exactly one of a list of strings
    GRAMMAR = "grammar"  # an EBNF grammar (xgrammar's / GBNF syntax; vLLM also takes Lark)


class Structured(msgspec.Struct, frozen=True, kw_only=True):
    """One structured-output constraint, normalized from whichever spelling the client used.

    Each engine's ``encode`` module writes it in that engine's own wire form. ``param`` names
    the request parameter it came from, so an engine's refusal of it becomes a 400 naming it.
    """

    kind: StructuredKind
    param: str
    # JSON: the schema as the client sent it (an object, or JSON text: each engine's front end
    # passes that form on); REGEX / GRAMMAR: the pattern or grammar text; otherwise None.
    spec: dict[str, Any] | str | None = None
    choices: tuple[str, ...] = ()  # CHOICE only
    # vLLM's per-request options, carried as vLLM's front end carries them.
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


# SGLang's (and TokenSpeed's) front end sends response_format json_object as this schema.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Regex metacharacters outside a character class; escaping others (`&`, `~`, `#`) makes xgrammar
# warn about an unknown escape.
_REGEX_META = frozenset("\\.^$|?*+()[]{}")
_REGEX_CONTROL = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


# The constraint written out last, how, and its text. A request's choices (up to 64 prompts x
# n) share one Structured and each goes to its engine as its own request: a 3 MB schema took
# 40 ms to write out, and 100,000 choices as a regex about as long, each time. The same object,
# not an equal one: comparing two big constraints costs about what writing one does. (It keeps
# that one constraint alive until another is written.)
_last_written: tuple[Structured, Callable[[Structured], str], str] | None = None


def written(s: Structured, write: Callable[[Structured], str]) -> str:
    """``write(s)``: an engine's text for a constraint, written once for all the engine
    requests of one client request (see ``_last_written``)."""
    global _last_written
    last = _last_written
    if last is not None and last[0] is s and last[1] is write:
        return last[2]
    text = write(s)
    _last_written = (s, write, text)
    return text


def schema_text(s: Structured) -> str:
    """A JSON / JSON_OBJECT constraint's schema as JSON text, the way SGLang's front end writes
    it (``json.dumps`` of an object schema, text passed on as given)."""
    if s.kind is StructuredKind.JSON_OBJECT:
        return JSON_OBJECT_SCHEMA
    if isinstance(s.spec, str):
        return s.spec
    return written(s, _dumped_schema)


def _dumped_schema(s: Structured) -> str:
    return json.dumps(s.spec)


def _choices_regex(s: Structured) -> str:
    return choice_regex(s.choices)


def choice_regex(choices: tuple[str, ...]) -> str:
    """A regex matching exactly one of ``choices``, for engines without a choice constraint.

    Metacharacters are escaped with a backslash; control characters are spelled ``\\n``,
    ``\\r``, ``\\t`` or ``\\uXXXX`` (xgrammar's regex reader does not match a ``\\xNN``).
    """

    def escape(text: str) -> str:
        out = []
        for ch in text:
            if ch in _REGEX_META:
                out.append("\\" + ch)
            elif ch in _REGEX_CONTROL:
                out.append(_REGEX_CONTROL[ch])
            elif ch < " " or ch == "\x7f":
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        return "".join(out)

    return "(" + "|".join(escape(c) for c in choices) + ")"


def grammar_fields(s: Structured | None) -> tuple[str | None, str | None, str | None]:
    """A constraint as SGLang's ``json_schema`` / ``regex`` / ``ebnf`` field (TokenSpeed, an
    SGLang fork, has the same three), written the way SGLang's OpenAI front end writes it:
    ``json_object`` is the schema ``{"type": "object"}``, an object schema is ``json.dumps``-ed.
    SGLang has no choice constraint: a choice is a regex of the escaped alternatives. vLLM's
    per-request whitespace options have no field here (the engine-wide switch is a launch flag).

    Returns ``(json_schema, regex, ebnf)``, at most one of them set.
    """
    if s is None:
        return None, None, None
    if s.kind is StructuredKind.JSON or s.kind is StructuredKind.JSON_OBJECT:
        return schema_text(s), None, None
    if s.kind is StructuredKind.CHOICE:
        return None, written(s, _choices_regex), None
    assert isinstance(s.spec, str)
    if s.kind is StructuredKind.REGEX:
        return None, s.spec, None
    return None, None, s.spec


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling parameters after smgd normalized and validated them.

    Backends translate these into their engine's form (SGLang's greedy rewrite, vLLM's
    ``_eos_token_id``...). Stop *strings* never reach an engine: smgd matches them on the
    detokenized text.
    """

    max_tokens: int
    temperature: float = 1.0  # 0.0 means greedy; each backend spells greedy its own way
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # The model's EOS ids; the engine stops on them unless ignore_eos. SGLang knows its own
    # EOS, vLLM only stops on EOS when the front end sends it.
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: sampled token only; k: plus top-k
    # The prompt's logprobs (vLLM's prompt_logprobs, SGLang's logprob_start_len 0): None for
    # none; k: each prompt token's logprob plus its top-k alternatives.
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured: Structured | None = None  # a structured-output constraint, if any

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One engine request: already tokenized, already validated."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool = True
    # The engine's scheduling priority (lower runs first; None: the engine's default). Only
    # for engines started with priority scheduling (``[[engines]] scheduling``).
    priority: int | None = None
    # The LoRA adapter to run with, by name (None: the base model). Each engine client maps
    # the name to its own :class:`LoraAdapter` when it encodes the request.
    lora: str | None = None


class LoraAdapter(msgspec.Struct, frozen=True, kw_only=True):
    """A LoRA adapter as an engine knows it: what a request with it carries on the wire."""

    name: str
    path: str  # the adapter's directory (adapter_config.json + weights), absolute
    int_id: int  # vLLM's lora_int_id: >= 1, unique per adapter on one engine


class EmbedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One engine embedding request (one input of ``/v1/embeddings``): tokenized, validated.

    ``dimensions`` keeps the first that many dimensions of the pooled vector (Matryoshka
    truncation, which the engine does before it normalizes); None keeps them all.
    """

    rid: str
    prompt_ids: list[int]
    dimensions: int | None = None


EngineRequest = GenerateRequest | EmbedRequest  # what an engine client submits


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS / stop token (engine) or stop string (smgd)
    LENGTH = "length"
    ABORT = "abort"  # aborted on request, or rejected by the engine
    ERROR = "error"  # engine-side failure for this request


class Finish(msgspec.Struct, frozen=True, kw_only=True):
    reason: FinishReason
    matched_token: int | None = None
    matched_text: str | None = None
    message: str | None = None
    status_code: int | None = None
    param: str | None = None  # the request parameter an engine's refusal is about


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token_id: int
    logprob: float
    top: list[TopLogprob] | None = None
    rank: int | None = None  # the token's rank in the vocabulary (1: most likely), if known


class TokenDelta(msgspec.Struct, kw_only=True):
    """New output of one request since the previous delta.

    ``token_ids`` are new ids only. Usage counts are cumulative and ``None`` when the frame
    did not carry them.
    """

    rid: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    # Logprobs of prompt tokens 1, 2, ... (the first token has none), in order; a request's
    # deltas carry them once, in one or more pieces, before or with its first output.
    prompt_logprobs: list[TokenLogprob] | None = None
    finish: Finish | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    embedding: list[float] | None = None  # an embedding request's vector (its final delta)

    def merge(self, later: TokenDelta) -> None:
        """Fold a later delta of the same request into this one (coalescing)."""
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(later.logprobs)
        if later.prompt_logprobs is not None:
            if self.prompt_logprobs is None:
                self.prompt_logprobs = []
            self.prompt_logprobs.extend(later.prompt_logprobs)
        if later.finish is not None:
            self.finish = later.finish
        if later.prompt_tokens is not None:
            self.prompt_tokens = later.prompt_tokens
        if later.completion_tokens is not None:
            self.completion_tokens = later.completion_tokens
        if later.cached_tokens is not None:
            self.cached_tokens = later.cached_tokens
        if later.embedding is not None:
            self.embedding = later.embedding


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine told us about itself at readiness (or what its model dir says)."""

    max_model_len: int
    vocab_size: int | None = None
    max_num_seqs: int | None = None
    kv_cache_tokens: int | None = None
    version: str | None = None


class EngineLoad(msgspec.Struct, frozen=True, kw_only=True):
    """Load an engine reports on its output frames, used by routing."""

    running: int = 0
    waiting: int = 0
    kv_usage: float | None = None

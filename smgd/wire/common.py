"""Engine-neutral request and output types.

Each engine's wire package translates its engine's structs to and from them: its ``encode``
module builds engine requests from a :class:`GenerateRequest`, its ``decode`` module turns engine
outputs into :class:`TokenDelta` values. Sans-IO: no sockets, no trio.
"""

from __future__ import annotations

import enum

import msgspec


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
    logit_bias: dict[int, float] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One engine request: already tokenized, already validated."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool = True


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


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token_id: int
    logprob: float
    top: list[TopLogprob] | None = None


class TokenDelta(msgspec.Struct, kw_only=True):
    """New output of one request since the previous delta.

    ``token_ids`` are new ids only. Usage counts are cumulative and ``None`` when the frame
    did not carry them.
    """

    rid: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish: Finish | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None

    def merge(self, later: TokenDelta) -> None:
        """Fold a later delta of the same request into this one (coalescing)."""
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(later.logprobs)
        if later.finish is not None:
            self.finish = later.finish
        if later.prompt_tokens is not None:
            self.prompt_tokens = later.prompt_tokens
        if later.completion_tokens is not None:
            self.completion_tokens = later.completion_tokens
        if later.cached_tokens is not None:
            self.cached_tokens = later.cached_tokens


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

"""The trio shell of ``/v1/embeddings``: one engine request per input, run together.

Each :class:`EmbedJob` opens its engine stream (admission, abort on the way out, as every
engine request), waits for the one final delta with the vector and keeps it. An engine that
dies or was not ready (never a 4xx-class refusal) passes the input to another ready engine of
the model, with a fresh engine rid, as a completion moves before its first token: nothing was
sent to the client yet. The first failure cancels the others (their engine requests are
aborted by ``open_stream``) and is raised. A
drain that runs out of time (:class:`~smgd.api.core.execute.Cutoff`) ends them the same way,
with the cutoff's error. Nothing is sent to the client meanwhile, so a cancel is always safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from smgd.api.core.errors import engine_finish_error
from smgd.api.core.pipeline import other_engine
from smgd.errors import EngineDead, EngineNotReady, SmgdError
from smgd.wire.common import FinishReason

if TYPE_CHECKING:
    from smgd.api.core.execute import Cutoff
    from smgd.engines.base import EngineClient
    from smgd.router import Router
    from smgd.wire.common import EmbedRequest, EngineInfo


# Engine failures worth another engine (as for completions): the engine died or was not ready.
_RETRYABLE = (EngineDead, EngineNotReady)

__all__ = ["EmbedJob", "run_embeddings"]

_FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32


@dataclass(slots=True)
class EmbedJob:
    engine: EngineClient
    request: EmbedRequest
    vector: list[float] | None = None
    prompt_tokens: int = 0
    queued_s: float = 0.0  # time its engine requests queued (smgd's admission, vLLM's own)
    router: Router | None = None  # set: the input may move to another engine of ``model``
    model: str = ""
    tried: set[str] = field(default_factory=set)
    # What engine.validate returned for the request when it was planned or moved
    # (open_stream's ``checked``).
    checked: EngineInfo | None = None


def _reroute(job: EmbedJob) -> bool:
    """Move a failed job to another ready engine of its model; False if there is none."""
    if job.router is None:
        return False
    moved = other_engine(
        job.router, job.model, job.engine, job.request, job.tried, kind="embedding"
    )
    if moved is None:
        return False
    job.engine, job.request, job.checked = moved
    return True


async def _run_one(job: EmbedJob) -> None:
    while True:
        try:
            await _attempt(job)
            return
        except _RETRYABLE:
            if not _reroute(job):
                raise


async def _attempt(job: EmbedJob) -> None:
    async with job.engine.open_stream(job.request, checked=job.checked) as stream:
        try:
            async for delta in stream:
                if delta.prompt_tokens is not None:
                    job.prompt_tokens = delta.prompt_tokens
                finish = delta.finish
                if finish is None:
                    continue
                if finish.reason in (FinishReason.ABORT, FinishReason.ERROR):
                    raise engine_finish_error(finish)
                if delta.embedding is None:
                    break
                job.vector = _float32_vector(delta.embedding, job.engine.name)
                return
        finally:
            job.queued_s += stream.queued_s  # a moved input queued on each engine it tried
    raise EngineDead(f"engine {job.engine.name} ended an embedding request without its vector")


def _float32_vector(vector: list[float], engine: str) -> list[float]:
    """``vector``, if every value is a finite float32, else the engine's error. A NaN or an
    infinity has no JSON number (it went out as ``null`` in a 200), and a value past float32's
    range no base64 (an internal error). Two C-level passes: ~0.1 ms for 4,096 values."""
    if all(map(math.isfinite, vector)) and (not vector or max(map(abs, vector)) <= _FLOAT32_MAX):
        return vector
    bad = next(x for x in vector if not (math.isfinite(x) and abs(x) <= _FLOAT32_MAX))
    raise EngineDead(
        f"engine {engine} returned an embedding with a value that is not a finite float32 ({bad})"
    )


async def run_embeddings(jobs: list[EmbedJob], cutoff: Cutoff) -> None:
    """Run every job to its vector; raise the first :class:`SmgdError` (the others cancelled)."""
    errors: list[SmgdError] = []

    async def run(job: EmbedJob, scope: trio.CancelScope) -> None:
        try:
            await _run_one(job)
        except SmgdError as err:
            errors.append(err)
            scope.cancel()

    scope = trio.CancelScope()
    cutoff.check()
    cutoff.watch(scope.cancel)
    try:
        with scope:
            if len(jobs) == 1:
                await _run_one(jobs[0])
            else:
                async with trio.open_nursery() as nursery:
                    for job in jobs:
                        nursery.start_soon(run, job, nursery.cancel_scope)
        if scope.cancelled_caught:
            cutoff.check()
        if errors:
            raise errors[0]
    finally:
        cutoff.unwatch(scope.cancel)

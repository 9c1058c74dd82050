"""vLLM V1 EngineCore client: smgd plays vLLM's own Python front end (AsyncLLM/InputProcessor).

Topology, handshake, ranks, death and re-attach come from
:class:`~smgd.engines.handshake.HandshakeEngineClient` (the handshake socket may be ipc or tcp;
stock ``vllm serve --headless`` only dials tcp, smgd's launcher any transport).

What the engine does not do and this client therefore does:

- validate before sending: a token id >= vocab or a prompt longer than ``max_model_len`` kills
  the engine, a body that fails its msgspec validation deafens it (the base class's
  :meth:`~smgd.engines.base.EngineClient.validate` checks vocab and context length);
- EOS: the engine stops on EOS only when ``_eos_token_id`` is sent, so a request that carries
  no EOS ids gets the model's (unless ``ignore_eos``);
- count ``completion_tokens`` (the wire only carries new ids) and take ``prompt_tokens`` from
  ``prefill_stats`` or the prompt;
- name the EOS token a STOP finish hit (the engine's ``stop_reason`` is None then);
- slice logprobs to each request's own top-k (the engine sends the batch-wide maximum);
- finish aborted requests locally (vLLM never answers a client abort).

Health probe (:meth:`VllmEngineClient.answers_probe`, :meth:`VllmEngineClient.probe_health`):
the utility call :data:`PROBE_METHOD` on every rank, answered between two steps by the engine
core's busy loop. So a silent engine that answers it lost the silent requests (they fail
alone), and an idle engine that does not is wedged (:mod:`smgd.engines.watchdogs`).
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from smgd.engines.handshake import Batch, HandshakeEngineClient
from smgd.errors import EngineDead, EngineNotReady, EngineRejected, InvalidRequest, ModelNotFound
from smgd.wire.common import EmbedRequest, FinishReason
from smgd.wire.vllm.decode import (
    UtilityReply,
    decode_handshake,
    decode_outputs,
    decode_ready_response,
)
from smgd.wire.vllm.encode import (
    encode_abort,
    encode_add,
    encode_embed,
    encode_init,
    encode_utility,
    lora_request,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from smgd.config import EngineConfig
    from smgd.wire.common import EngineInfo, EngineRequest, LoraAdapter, TokenDelta

log = logging.getLogger("smgd.engine.vllm")

# How long a utility call (add_lora) may take. Loading an adapter reads its weights from disk
# and moves them to the device: well under a second for a small one, tens of seconds for a
# multi-GB adapter on a slow disk; 120 s leaves room for that and still ends a wedged call.
UTILITY_TIMEOUT_S = 120.0
# vLLM's message for an adapter directory it cannot find (LoRAAdapterNotFoundError).
_NOT_FOUND = "No adapter found for"
# The health probe: a utility call the engine core's busy loop answers between two steps (it
# drains its input queue before each), so an answer proves the loop turns. vLLM 0.32.0's
# EngineCore.is_sleeping reads two flags (the scheduler's pause state, the executor's sleep
# tags) and asks no worker: cheap, and a sleeping or paused engine answers too. Any answer
# counts, a failure included ("Server shutting down", a version without the method): the loop
# that wrote it is alive.
PROBE_METHOD = "is_sleeping"


class _Call:
    """One rank's answer to one utility call, once it arrives."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.reply: UtilityReply | None = None


class _Meta(msgspec.Struct):
    """What the client must remember per request to complete vLLM's deltas."""

    prompt_tokens: int
    generated: int = 0
    logprobs_k: int | None = None


class VllmEngineClient(HandshakeEngineClient):
    wire = "vllm"

    def __init__(
        self, config: EngineConfig, *, eos_token_ids: tuple[int, ...] = (), **kwargs: Any
    ) -> None:
        super().__init__(config, **kwargs)
        self.eos_token_ids = eos_token_ids
        self._meta: dict[str, _Meta] = {}
        self._logprobs_k: dict[str, int | None] = {}
        self._calls: dict[int, _Call] = {}  # utility calls in flight, by call_id

    def _wire_status(self, payload: bytes) -> str:
        return decode_handshake([payload]).status

    def _wire_init(self, inputs: list[str], outputs: list[str]) -> list[bytes]:
        return encode_init(inputs, outputs)

    def _wire_registration(self, payload: bytes) -> tuple[EngineInfo, int]:
        resp = decode_ready_response([payload])
        # data_parallel_size > 1 here means a lockstep (MoE) group that needs the wave
        # protocol; dense-DP engines report 1. The rank count comes from the config.
        return resp.engine_info(), resp.data_parallel_size

    def _wire_add(self, req: EngineRequest) -> list[bytes]:
        if isinstance(req, EmbedRequest):
            self._meta[req.rid] = _Meta(prompt_tokens=len(req.prompt_ids))
            return encode_embed(req)
        sp = req.sampling
        if sp.max_tokens < 1:
            # The engine asserts max_tokens >= 1; a failed assert kills its input thread.
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        if not sp.eos_token_ids and not sp.ignore_eos and self.eos_token_ids:
            sp = msgspec.structs.replace(sp, eos_token_ids=self.eos_token_ids)
            req = msgspec.structs.replace(req, sampling=sp)
        lora = None if req.lora is None else self.lora.get(req.lora)
        frames = encode_add(req, structured_backend=structured_backend(self.config), lora=lora)
        self._meta[req.rid] = _Meta(prompt_tokens=len(req.prompt_ids), logprobs_k=sp.logprobs)
        if sp.logprobs is not None:
            self._logprobs_k[req.rid] = sp.logprobs
        return frames

    def _wire_abort(self, rid: str) -> list[bytes]:
        self._forget(rid)
        return encode_abort([rid])

    def _forget(self, rid: str) -> None:
        super()._forget(rid)
        self._meta.pop(rid, None)
        self._logprobs_k.pop(rid, None)

    def _wire_outputs(self, frames: list[Any]) -> Batch:
        views = [memoryview(f) for f in frames]
        out = decode_outputs(views, logprobs_k=self._logprobs_k or None)
        if out.utility is not None and (call := self._calls.get(out.utility.call_id)):
            call.reply = out.utility
            call.done.set()
        if out.lora_running is not None and out.lora_waiting is not None and self.lora.enabled:
            self.lora.report(out.engine_index, out.lora_running, out.lora_waiting)
        for delta in out.deltas:
            meta = self._meta.get(delta.rid)
            if meta is None:
                continue  # a late frame for a finished/aborted request: dropped by deliver()
            meta.generated += len(delta.token_ids)
            delta.completion_tokens = meta.generated
            if delta.prompt_tokens is None:
                delta.prompt_tokens = meta.prompt_tokens
            finish = delta.finish
            if (
                finish is not None
                and finish.reason is FinishReason.STOP
                and finish.matched_token is None
                and finish.matched_text is None
                and delta.token_ids
            ):
                # vLLM says stop_reason=None when EOS ended the request, EOS being the last
                # token. Name it, as SGLang does, so the text drops it as vLLM's own
                # detokenizer does (even with skip_special_tokens=False).
                delta.finish = msgspec.structs.replace(finish, matched_token=delta.token_ids[-1])
        return Batch(out.deltas, out.engine_index, out.load, out.queue_times)

    def _grammar_refusal(self, delta: TokenDelta) -> str | None:
        # A grammar the engine core cannot compile (or a backend it cannot build) fails only
        # that request, before its first token, with finish reason ERROR and no message.
        meta = self._meta.get(delta.rid)
        assert delta.finish is not None
        if delta.finish.reason is FinishReason.ERROR and meta is not None and not meta.generated:
            return "its grammar backend failed to compile it (vLLM sends no reason; see its log)"
        return None

    def die(self, reason: str) -> None:
        super().die(reason)
        self._meta.clear()
        self._logprobs_k.clear()
        for call in self._calls.values():
            call.done.set()  # no reply: the caller sees the engine's death

    # ------------------------------------------------------------------ utility calls

    async def call_utility(self, method: str, *args: Any) -> list[UtilityReply]:
        """Call ``method`` on every rank (as vLLM's DP client does for add_lora); one reply
        per rank. Raises :class:`EngineDead` if the engine dies or does not answer in time."""
        if self.table is None:
            raise EngineNotReady(f"engine {self.name} is {self.state_name}")
        replies = await self._call_ranks(method, args, UTILITY_TIMEOUT_S)
        if self._death is not None:
            raise EngineDead(f"engine {self.name} failed during {method}: {self.last_error}")
        if any(r is None for r in replies):
            raise EngineDead(
                f"engine {self.name}: no answer to {method} within {UTILITY_TIMEOUT_S:g} s"
            )
        return [r for r in replies if r is not None]

    async def _call_ranks(
        self, method: str, args: Sequence[Any], limit_s: float
    ) -> list[UtilityReply | None]:
        """Send ``method`` to every rank, each under a call id of its own; each rank's reply,
        None for a rank that sent none within ``limit_s`` (or if the engine died meanwhile).

        A reply is taken by its call id alone, so a reply to another call (an earlier probe's,
        come late) is never taken for this one's. The ids leave the table however this ends
        (answered, timed out, cancelled): a reply that comes later finds no call and is
        dropped by :meth:`_wire_outputs`.
        """
        assert self.table is not None
        calls: list[_Call] = []
        ids: list[int] = []
        try:
            for rank in self.table.ranks:
                call_id = random.getrandbits(64)  # vLLM: uuid1().int >> 64
                while call_id in self._calls:  # one in flight has it: its reply is its own
                    call_id = random.getrandbits(64)
                call = self._calls[call_id] = _Call()
                ids.append(call_id)
                calls.append(call)
                self._outbox_send.send_nowait(
                    [rank.identity, *encode_utility(call_id, method, list(args))]
                )
            with trio.move_on_after(limit_s):
                for call in calls:
                    await call.done.wait()
            return [call.reply for call in calls]
        finally:
            for call_id in ids:
                self._calls.pop(call_id, None)

    async def _unanswering_ranks(self, limit_s: float) -> list[int] | None:
        """The ranks that did not answer a health probe (:data:`PROBE_METHOD`) within
        ``limit_s`` (all of them if the engine died meanwhile); None before the ranks
        registered (nothing to probe, nothing proven).

        Every rank is probed and must answer: smgd runs the ranks as one engine (one rank's
        death is the engine's), and its least-load pick would keep sending requests to a
        wedged rank, more of them as the ones it lost are failed alone. So a rank that does
        not answer is a wedged engine, not a lost request.

        Probes may overlap (the idle prober's with the silence watchdog's, as requests come
        and go): each is judged by its own call ids' replies alone, so neither waits out the
        other's limit (a lock, as the SGLang client's one health rid needs, would add up to
        ``health_timeout_s`` to the watchdog's verdict).
        """
        if self.table is None:
            await trio.lowlevel.checkpoint()
            return None
        ranks = [rank.index for rank in self.table.ranks]
        replies = await self._call_ranks(PROBE_METHOD, (), limit_s)
        if self._death is not None:
            return ranks
        return [index for index, reply in zip(ranks, replies, strict=True) if reply is None]

    async def answers_probe(self, limit_s: float) -> bool:
        return await self._unanswering_ranks(limit_s) == []

    async def probe_health(self, limit_s: float) -> None:
        silent = await self._unanswering_ranks(limit_s)
        if silent and self._death is None:
            ranks = ", ".join(map(str, silent))
            self.die(
                f"no answer to a health check (utility call {PROBE_METHOD}) within "
                f"{limit_s:g} s from rank(s) {ranks}"
            )

    async def add_lora(self, adapter: LoraAdapter, *, load_inplace: bool = False) -> None:
        """The engine core's ``add_lora``: load the adapter's weights (validating them).
        Raises :class:`ModelNotFound` (no adapter at the path) or :class:`EngineRejected`."""
        request = lora_request(adapter)
        request.load_inplace = load_inplace
        for reply in await self.call_utility("add_lora", request):
            message = reply.failure_message
            if message is None:
                continue
            if _NOT_FOUND in message:
                raise ModelNotFound(message, param="lora_path", code="lora_not_found")
            raise EngineRejected(
                f"engine {self.name} could not load adapter {adapter.name!r}: {message}",
                param="lora_path",
            )

    async def load_adapter(
        self, name: str, path: str, *, load_inplace: bool = False
    ) -> LoraAdapter:
        if not self.lora.enabled:
            raise InvalidRequest(
                f"engine {self.name} runs without LoRA ([engines.lora] is not set)",
                param="lora_name",
            )
        adapter = self.lora.new(name, path)
        await self.add_lora(adapter, load_inplace=load_inplace)
        self.lora.add(adapter)
        return adapter

    async def _become_ready(self) -> EngineInfo:
        info = await super()._become_ready()
        # vLLM's engine core learns adapters from add_lora or a request; add the start-up ones
        # now, as vLLM's own server does, so a broken one shows here rather than killing the
        # engine core on its first request.
        for adapter in list(self.lora):
            try:
                await self.add_lora(adapter)
            except (ModelNotFound, EngineRejected) as exc:
                self.lora.remove(adapter.name)
                log.error("engine %s: adapter %s not served: %s", self.name, adapter.name, exc)
        return info


def structured_backend(config: EngineConfig) -> str:
    """The structured-output backend the engine core is told to build (``_backend``)."""
    so = config.structured_output
    if so.backend == "auto" and so.disable_any_whitespace:
        return "xgrammar"  # launched with it named: vLLM's auto cannot disable whitespace
    return so.backend


def vllm_argv(*, python: str, launcher: str, model: str, args: list[str]) -> list[str]:
    """smgd's headless engine-core launcher dialing ``{handshake}`` (filled in at bind)."""
    return [python, launcher, "--handshake-address", "{handshake}", "--model", model, *args]

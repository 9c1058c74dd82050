"""The mock engine on vLLM's EngineCore wire: it dials smgd like one headless engine core.

Engine side of the handshake (identity = engine index, 2 bytes LE): DEALER → smgd's handshake
ROUTER, HELLO; INIT names the input/output addresses; connect the input DEALER and the output
PUSH; the ready response (``EngineCoreReadyResponse``) on the input DEALER, then READY.

vLLM behaviour it reproduces: EOS stops a request only when ``_eos_token_id`` was sent;
``stop_token_ids`` finish with ``stop_reason`` = the id; a client abort gets no output at all;
``prefill_stats`` on a request's first output; ``scheduler_stats`` on every step (as with
log_stats on); sampled-token logprobs plus top-k columns; an undecodable request is dropped
(vLLM's input thread would die; the silence watchdog is smgd's answer to either);
utility calls are answered at once, between steps, as the engine core's busy loop does (under
the ``lose`` fault too: the engine that lost a request answers smgd's health probe);
:meth:`VllmMockWire.request_death` makes the next step send ``ENGINE_CORE_DEAD``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from smgd.errors import WireError
from smgd.mock.engine import GARBAGE, connect_data_sockets, record, record_in
from smgd.mock.scheduler import MockFinish, MockRequest, MockScheduler, StepOutput
from smgd.wire.vllm.decode import decode_init, decode_request
from smgd.wire.vllm.engine_side import (
    encode_engine_dead,
    encode_hello,
    encode_outputs,
    encode_ready,
    encode_ready_response,
    logprobs_lists,
    prompt_logprobs_tensors,
)
from smgd.wire.vllm.structs import (
    AbortRequest,
    AddRequest,
    EngineCoreEvent,
    EngineCoreOutput,
    EngineCoreOutputs,
    PrefillStats,
    ReadyResponse,
    SamplingParams,
    UtilityOutput,
    UtilityRequest,
    UtilityResult,
    VllmFinishReason,
)
from smgd.wire.vllm.tensors import make_tensor
from smgd.zmq_trio import TrioSocket

if TYPE_CHECKING:
    from collections.abc import Sequence

log = logging.getLogger("smgd.mock.vllm")

# vLLM's default block size on CPU; only reported.
BLOCK_TOKENS = 128
_FINISH = {
    MockFinish.STOP: VllmFinishReason.STOP,
    MockFinish.LENGTH: VllmFinishReason.LENGTH,
    MockFinish.ABORT: VllmFinishReason.ABORT,
    MockFinish.EMBEDDED: VllmFinishReason.STOP,  # a pooling request finishes "stopped"
}


QUEUED, SCHEDULED = 1, 2  # EngineCoreEventType

# Utility calls the mock answers (a generate-only engine, awake: smgd's health probe asks
# is_sleeping); the rest are answered with None.
UTILITY_ANSWERS: dict[str, object] = {"get_supported_tasks": ["generate"], "is_sleeping": False}


class VllmMockWire:
    def __init__(
        self,
        handshake: str,
        *,
        engine_index: int = 0,
        context_len: int = 4096,
        max_batch: int = 256,
        log_stats: bool = True,
        local: bool = True,
    ) -> None:
        self.handshake = handshake
        # vLLM's own front end started with --data-parallel-size-local 0 only accepts engines
        # whose HELLO/READY say `local: false`; smgd accepts either.
        self.local = local
        self.identity = engine_index.to_bytes(2, "little")
        self.engine_index = engine_index
        self.context_len = context_len
        self.max_batch = max_batch
        self.log_stats = log_stats
        self.handshakes = 0
        self.received: list[str] = []  # every request id an ADD arrived for
        self.aborts: list[str] = []
        self.eos_seen: dict[str, int | None] = {}  # rid -> the _eos_token_id it carried
        self.dropped = 0
        self._client_aborted: set[str] = set()
        self._eos: dict[str, int | None] = {}
        self._logprobs: dict[str, int] = {}
        self._prefilled: set[str] = set()
        self._queued_at: dict[str, float] = {}  # rid -> its ADD's arrival (log_stats)
        self._die = False
        self.loras: dict[int, str] = {}  # adapters the engine holds: lora_int_id -> name
        self.utility_calls: list[str] = []  # the method of every utility call received

    def request_death(self) -> None:
        self._die = True

    def ready_response(self) -> ReadyResponse:
        return ReadyResponse(
            max_model_len=self.context_len,
            num_gpu_blocks=self.context_len * self.max_batch // BLOCK_TOKENS,
            block_size=BLOCK_TOKENS,
            dtype="float32",
            vllm_version="0.32.0-mock",
            data_parallel_rank=self.engine_index,
            max_num_seqs=self.max_batch,
            kv_cache_size_tokens=self.context_len * self.max_batch,
        )

    async def open(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> tuple[TrioSocket, TrioSocket]:
        hs = TrioSocket(ctx.socket(zmq.DEALER))
        try:
            hs.socket.setsockopt(zmq.LINGER, 0)
            hs.socket.setsockopt(zmq.IDENTITY, self.identity)
            hs.socket.connect(self.handshake)
            await hs.send_multipart(encode_hello(local=self.local, headless=True))
            reply = await hs.recv_multipart(copy=True)
            init = decode_init(reply[-1:])
            in_sock, out_sock = connect_data_sockets(
                ctx, self.identity, init.addresses.inputs[0], init.addresses.outputs[0]
            )
            await in_sock.send_multipart(encode_ready_response(self.ready_response()))
            await hs.send_multipart(encode_ready(local=self.local, headless=True))
            self.handshakes += 1
            return in_sock, out_sock
        finally:
            hs.close()

    def on_request(self, frames: Sequence[bytes], sched: MockScheduler) -> list[list[bytes]]:
        try:
            msg = decode_request(frames)
        except WireError as exc:
            self.dropped += 1
            log.warning("mock vllm: dropping undecodable request: %s", exc)
            return []
        if isinstance(msg, AbortRequest):
            for rid in msg.request_ids:
                record(self.aborts, rid)
                # Only a request still queued or running answers (or not) to it: the abort of
                # one that finished (the client hung up as it ended) kept its rid here for good.
                if sched.abort(rid):
                    self._client_aborted.add(rid)
                else:  # (a request the "lose" fault dropped: it never finishes in a step)
                    for table in (self._eos, self._logprobs, self._queued_at):
                        table.pop(rid, None)
            return []
        if isinstance(msg, UtilityRequest):
            # vLLM's API server asks this at start-up and waits for the answer; LoRA calls
            # as the engine answers them; other utility calls get None (the call succeeded,
            # nothing to report).
            record(self.utility_calls, msg.method)
            failure, value = self._lora_utility(msg)
            if failure is None and value is None:
                value = UTILITY_ANSWERS.get(msg.method)
            result = None if failure is not None else UtilityResult(None, value)
            out = EngineCoreOutputs(
                engine_index=self.engine_index,
                utility_output=UtilityOutput(msg.call_id, failure, result),
            )
            return [encode_outputs(out)]
        if not isinstance(msg, AddRequest):
            return []  # DP waves: not modelled
        req = msg.request
        record(self.received, req.request_id)
        if self.log_stats:
            self._queued_at[req.request_id] = time.monotonic()
        if req.pooling_params is not None:  # an embedding request (--runner pooling)
            sched.add(
                MockRequest(
                    rid=req.request_id,
                    prompt_ids=list(req.prompt_token_ids or ()),
                    max_tokens=0,
                    embed=True,
                    dimensions=req.pooling_params.dimensions,
                )
            )
            return []
        sp = req.sampling_params or SamplingParams()
        eos = sp._eos_token_id
        record_in(self.eos_seen, req.request_id, eos)
        self._eos[req.request_id] = eos
        if sp.logprobs is not None:
            self._logprobs[req.request_id] = sp.logprobs
        # vLLM's min_tokens masks _all_stop_token_ids: without them (a front end that sent
        # none) EOS is not held back.
        min_tokens = sp.min_tokens if sp._all_stop_token_ids else 0
        stops = set(sp.stop_token_ids or ())
        if eos is not None:
            stops.add(eos)  # the engine stops on EOS only because the front end sent it
        lora = _lora_name(req.lora_request)
        if lora is not None:
            self.loras[_lora_id(req.lora_request)] = lora  # the engine loads it on first use
        sched.add(
            MockRequest(
                rid=req.request_id,
                prompt_ids=list(req.prompt_token_ids or ()),
                max_tokens=sp.max_tokens if sp.max_tokens is not None else 16,
                stop_token_ids=frozenset(stops),
                prompt_logprobs=sp.prompt_logprobs,
                min_tokens=min_tokens,
                priority=req.priority,
                lora=lora,
            )
        )
        return []

    def _lora_utility(self, msg: UtilityRequest) -> tuple[str | None, object]:
        """(failure message, result) of a LoRA utility call, as vLLM's engine core answers
        (``add_lora``: True, or vLLM's not-found message for a directory without
        adapter_config.json; ``remove_lora``: whether it was loaded; ``list_loras``: the
        ids). (None, None) for any other method."""
        if msg.method == "add_lora" and msg.args:
            name, lora_id, path = _lora_name(msg.args[0]), _lora_id(msg.args[0]), msg.args[0][2]
            if not (Path(path) / "adapter_config.json").is_file():
                return f"Loading lora {name} failed: No adapter found for {path}", None
            self.loras[lora_id] = name or ""
            return None, True
        if msg.method == "remove_lora" and msg.args:
            return None, self.loras.pop(msg.args[0], None) is not None
        if msg.method == "list_loras":
            return None, sorted(self.loras)
        return None, None

    def _output(self, o: StepOutput) -> EngineCoreOutput:
        out = EngineCoreOutput(request_id=o.rid, new_token_ids=o.new_ids)
        if o.embedding is not None:
            out.pooling_output = make_tensor("float32", [len(o.embedding)], o.embedding)
        if o.finish is not None:
            out.finish_reason = int(_FINISH[o.finish])
            if o.finish is MockFinish.STOP and o.matched != self._eos.get(o.rid):
                out.stop_reason = o.matched  # a stop token id; EOS reports none
        if o.rid not in self._prefilled:
            self._prefilled.add(o.rid)
            queued = self._queued_at.pop(o.rid, None)
            if queued is not None:
                # vLLM's request events: queued at ADD, scheduled by the step that produced
                # its first output (this one).
                out.events = [
                    EngineCoreEvent(QUEUED, queued),
                    EngineCoreEvent(SCHEDULED, time.monotonic()),
                ]
            out.prefill_stats = PrefillStats(
                num_prompt_tokens=o.prompt_tokens,
                num_computed_tokens=o.prompt_tokens - o.cached_tokens,
                num_cached_tokens=o.cached_tokens,
            )
        k = self._logprobs.get(o.rid)
        if k is not None and o.new_ids:
            rows = [[t, *(t + j for j in range(1, k + 1))] for t in o.new_ids]
            vals = [[-0.5 * (j + 1) for j in range(k + 1)] for _ in o.new_ids]
            out.new_logprobs = logprobs_lists(rows, vals, [1] * len(rows))
        if o.prompt_logprobs:
            out.new_prompt_logprobs_tensors = prompt_logprobs_tensors(o.prompt_logprobs)
        return out

    def encode_step(
        self, outputs: list[StepOutput], aborted_queued: list[str], sched: MockScheduler
    ) -> list[list[bytes]]:
        if self._die:
            return [encode_engine_dead()]
        items: list[EngineCoreOutput] = []
        for o in outputs:
            if o.finish is MockFinish.ABORT and o.rid in self._client_aborted:
                self._client_aborted.discard(o.rid)  # vLLM never answers a client abort
            else:
                items.append(self._output(o))
            if o.finish is not None:
                for table in (self._eos, self._logprobs, self._queued_at):
                    table.pop(o.rid, None)
                self._prefilled.discard(o.rid)
        self._client_aborted.difference_update(aborted_queued)
        for rid in aborted_queued:  # (they never finish in a step: forgotten here, or never)
            for table in (self._eos, self._logprobs, self._queued_at):
                table.pop(rid, None)
        if not items and not (self.log_stats and (outputs or aborted_queued)):
            return []  # with log_stats vLLM sends a stats-only message after finishes/aborts
        stats = None
        if self.log_stats:
            stats = {
                "num_running_reqs": len(sched.running),
                "num_waiting_reqs": len(sched.waiting),
                "kv_cache_usage": len(sched.running) / self.max_batch,
                # Requests per LoRA adapter in each queue, as vLLM's SchedulerStats has them.
                "waiting_lora_adapters": dict(Counter(r.lora for r in sched.waiting if r.lora)),
                "running_lora_adapters": dict(
                    Counter(r.lora for r in sched.running.values() if r.lora)
                ),
            }
        batch = EngineCoreOutputs(
            engine_index=self.engine_index, outputs=items, scheduler_stats=stats
        )
        return [encode_outputs(batch)]

    def garbage(self) -> list[bytes]:
        return [GARBAGE]


def _lora_name(lora_request: Any) -> str | None:
    """The adapter name of a LoRARequest as it arrives (a positional array), or None."""
    return str(lora_request[0]) if isinstance(lora_request, list) and lora_request else None


def _lora_id(lora_request: Any) -> int:
    return int(lora_request[1])

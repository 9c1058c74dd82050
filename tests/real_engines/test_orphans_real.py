"""smgd kill -9 with a REAL launched engine (vLLM engine core + worker, SGLang launcher +
scheduler): the whole engine tree is gone within seconds, and smgd started again on the same
config is ready and serves (issue 18, item 2: before, the vLLM orphan held rank 0's identity
on the new input socket and the new engine never registered; the SGLang orphan joined the
request socket as a second scheduler).

Needs both engine venvs::

    set -a; eval "$(bash .ci/vllm-env.sh)"; eval "$(bash .ci/sglang-env.sh)"; set +a
    .venv/bin/python -m pytest -m real_engine -s tests/real_engines/test_orphans_real.py
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import trio

from ..faults.harness import alive, daemon_toml, descendants, serve, stream, until
from .test_sglang_raw import SCHEDULER_ARGS as RAW_SCHEDULER_ARGS
from .test_vllm_daemon import ENGINE_ARGS as VLLM_ARGS

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

STARTUP_S = 300.0  # ~50 s for either engine here; a loaded 2-core box can take much longer
# Both engines' processes die from the kernel's death signal or a pidfd wakeup: milliseconds.
GONE_WITHIN_S = 5.0
SGLANG_ARGS = ["--cpu-shims", *(a for a in RAW_SCHEDULER_ARGS if a != "--skip-tokenizer-init")]


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set: run the engine's .ci/*-env.sh first")
    return value


def _engine_toml(wire: str) -> str:
    python, model = _env(f"{wire.upper()}_PYTHON"), _env(f"{wire.upper()}_MODEL")
    args = VLLM_ARGS if wire == "vllm" else SGLANG_ARGS
    return (
        f'[[engines]]\nname = "e0"\nwire = "{wire}"\nmodels = ["m"]\nmodel_dir = "{model}"\n'
        f"[engines.timeouts]\nready_s = {STARTUP_S}\n"
        f'[engines.launch]\nkind = "{wire}"\npython = "{python}"\nargs = {json.dumps(args)}\n'
    )


async def _all_gone(pids: list[int]) -> bool:
    return not any(alive(pid) for pid in pids)


@pytest.mark.parametrize("wire", ["vllm", "sglang"])
async def test_smgd_kill9_takes_the_real_engine_tree_along(tmp_path: Path, wire: str) -> None:
    config = daemon_toml(_engine_toml(wire))
    async with serve(tmp_path, config, wait_ready=False) as daemon:
        await daemon.wait_ready(STARTUP_S)
        tree = descendants(daemon.proc.pid)
        assert len(tree) >= 2, f"the engine and a child of it expected, found {tree}"
        daemon.send_signal(signal.SIGKILL)
        await daemon.wait_exit(5)
        killed_at = trio.current_time()
        try:
            await until(lambda: _all_gone(tree), GONE_WITHIN_S, poll_s=0.01)
        except BaseException:
            for pid in filter(alive, tree):
                os.kill(pid, signal.SIGKILL)
            raise
        print(f"TIMING {wire}_tree_gone {trio.current_time() - killed_at:.3f} ({len(tree)} pids)")
    async with serve(tmp_path, config, wait_ready=False) as again:
        with trio.fail_after(STARTUP_S):
            await again.wait_ready(STARTUP_S)
        async with again.client() as client:
            outcome = await stream(client, "m", "def hello(world):", 8)
        assert outcome.status == 200 and outcome.error is None, outcome
        assert outcome.done

"""What smgd's SGLang launch leaves resident on the host (issue 21): once the scheduler is
ready, the process smgd started IS the scheduler. Before, the launcher imported torch and
sglang, spawned the scheduler and waited on it, resident at ~590 MiB for nothing.

Needs the SGLang venv::

    eval "$(bash .ci/sglang-env.sh)"
    .venv/bin/python -m pytest -m real_engine -s tests/real_engines/test_launcher_rss.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from smgd.bench import procstat

from ..faults.harness import daemon_toml, descendants, serve, stream
from .test_sglang_raw import SCHEDULER_ARGS as RAW_SCHEDULER_ARGS

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

STARTUP_S = 300.0  # ~20 s here; a loaded 2-core box can take much longer
# A Python process with torch imported is ~500 MiB resident; smgd's own tree without an
# engine stays far below (the daemon ~55 MiB, a multiprocessing resource tracker ~12 MiB).
HEAVY_KIB = 100 * 1024


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f'{name} is not set: run `eval "$(bash .ci/sglang-env.sh)"` first')
    return value


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


async def test_the_launched_process_is_the_scheduler_and_nothing_heavy_waits_beside_it(
    tmp_path: Path,
) -> None:
    python, model = _env("SGLANG_PYTHON"), _env("SGLANG_MODEL")
    args = ["--cpu-shims", *(a for a in RAW_SCHEDULER_ARGS if a != "--skip-tokenizer-init")]
    engine = (
        f'[[engines]]\nname = "e0"\nwire = "sglang"\nmodels = ["m"]\nmodel_dir = "{model}"\n'
        f"[engines.timeouts]\nready_s = {STARTUP_S}\n"
        f'[engines.launch]\nkind = "sglang"\npython = "{python}"\nargs = {json.dumps(args)}\n'
    )
    async with serve(tmp_path, daemon_toml(engine), wait_ready=False) as daemon:
        await daemon.wait_ready(STARTUP_S)
        async with daemon.client() as client:
            outcome = await stream(client, "m", "def hello(world):", 8)
        assert outcome.status == 200 and outcome.error is None, outcome
        smgd = daemon.proc.pid
        tree = descendants(smgd)
        rss = {pid: procstat.rss_kib([pid]) for pid in tree}
        heavy = [pid for pid in tree if rss[pid] > HEAVY_KIB]
        described = {pid: (_cmdline(pid)[:80], rss[pid] // 1024) for pid in tree}
        print(f"RSS MiB of smgd's engine tree: {described}")
        assert len(heavy) == 1, f"one heavy process (the scheduler) expected: {described}"
        [scheduler] = heavy
        stat = procstat.read_stat(scheduler)
        assert stat is not None
        assert stat.ppid == smgd, "the process smgd started is the scheduler itself"
        assert "sglang::scheduler" in _cmdline(scheduler)

"""Real engines in the bench: smgd vs the engine's own server, on the same engine, same load.

- ``sglang-real``: SGLang's scheduler on CPU (``SGLANG_PYTHON``, ``SGLANG_MODEL``), once behind
  smgd (``[engines.launch] kind = "sglang"``) and once behind SGLang's own server
  (``python -m sglang.launch_server``), with the same scheduler flags (:data:`SGLANG_FLAGS`).
- ``vllm-real``: vLLM's engine core on CPU (``VLLM_PYTHON``, ``VLLM_MODEL``), once behind smgd
  (``kind = "vllm"``) and once behind ``vllm serve`` (its AsyncLLM OpenAI server), with the
  same engine flags (:data:`VLLM_FLAGS`).

Both servers of a target run at once, and each point is measured on one, then the other,
in an order that alternates from point to point and from round to round, so a slow stretch
of a shared machine falls on both alike. The load is the loadgen's ``count`` mode (a random
model's text is not known in advance: each stream is checked by its usage, ``ignore_eos``).

Which processes count (:func:`classify`): each server's process tree, from the process the
bench started, split by command line. The engine is every process whose command line holds
one of :attr:`RealEngine.engine_marks` (the titles SGLang and vLLM give their scheduler and
engine core, ``sglang::scheduler`` and ``VLLM::EngineCore``), with all its descendants; it is
the same engine on both sides and is reported apart (``engine_cpu_s``). Everything else in
the tree is the front end: for smgd, smgd itself and any launcher process left beside the
engine; for SGLang, the ``launch_server`` process (HTTP server and TokenizerManager) and the
``sglang::detokenizer``; for vLLM, the API server process (and any helper it starts). CPU
is ``utime + stime`` from ``/proc/<pid>/stat``; memory is PSS from ``/proc/<pid>/smaps_rollup``
(RSS beside it), so the pages two processes share are not counted twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from smgd.bench import procstat, report
from smgd.bench.runner import (
    Measured,
    Proc,
    cmdline,
    free_port,
    measure_http_point,
    start,
    wait_ready,
)
from smgd.bench.vllm_frontend import _SHIM as VLLM_CLI_SHIM
from smgd.launchers import cpu_shims_dir

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from smgd.bench.workload import Workload

log = logging.getLogger("smgd.bench")

SERVED_NAME = "tiny"
# Where .ci/sglang-server-extras.sh put what SGLang's own HTTP server needs beyond its venv.
SGLANG_EXTRAS_ENV = "SGLANG_SERVER_EXTRAS"
# Either engine imports torch and loads the model: 20-60 s here, far longer on a loaded box.
READY_TIMEOUT_S = 600.0
# A few requests before the first point, so first-use costs (lazy imports, the first batch
# shapes, smgd's detokenizer caches) are not measured.
WARMUP_CONCURRENCY = 4
WARMUP_S = 3.0
# SGLang's scheduler on CPU: the flags of tests/real_engines, with room for 64 streams of
# P + M = 128 tokens (64 x 128 = 8192 KV slots; 16384 leaves the radix cache room).
SGLANG_FLAGS = (
    "--device", "cpu",
    "--dtype", "float32",
    "--max-total-tokens", "16384",
    "--max-running-requests", "64",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-overlap-schedule",
    "--grammar-backend", "none",
    "--cuda-graph-backend-decode=disabled",
    "--cuda-graph-backend-prefill=disabled",
    "--sleep-on-idle",
)  # fmt: skip
# 64 MiB of KV cache holds 65k tokens of the tiny model: 64 streams of 128 tokens many times.
VLLM_KV_BYTES = 64 * 1024 * 1024
VLLM_FLAGS = (
    "--dtype", "float32",
    "--max-model-len", "512",
    "--max-num-seqs", "64",
    "--enforce-eager",
    "--kv-cache-memory-bytes", str(VLLM_KV_BYTES),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RealEngine:
    """One real-engine target: which venv and model, and how its engine processes are named."""

    target: str  # the bench target, e.g. "sglang-real"
    wire: str  # smgd's wire and launch kind for it
    own: str  # name of the engine's own server side
    python_env: str
    model_env: str
    engine_marks: tuple[str, ...]  # command-line substrings of the engine's root processes
    flags: tuple[str, ...]


SGLANG = RealEngine(
    "sglang-real",
    "sglang",
    "sglang",
    "SGLANG_PYTHON",
    "SGLANG_MODEL",
    ("sglang::scheduler",),
    SGLANG_FLAGS,
)
VLLM = RealEngine(
    "vllm-real",
    "vllm",
    "vllm",
    "VLLM_PYTHON",
    "VLLM_MODEL",
    ("VLLM::EngineCore",),
    VLLM_FLAGS,
)
ENGINES = {e.target: e for e in (SGLANG, VLLM)}
TARGETS = tuple(ENGINES)


def unavailable(engine: RealEngine) -> str | None:
    """Why this target cannot run here (None: it can)."""
    python = os.environ.get(engine.python_env)
    if not python or not Path(python).exists():
        return f'{engine.python_env} is not set (eval "$(bash .ci/{engine.wire}-env.sh)")'
    model = os.environ.get(engine.model_env)
    if not model or not (Path(model) / "config.json").exists():
        return f"{engine.model_env} is not set to a model dir"
    extras = os.environ.get(SGLANG_EXTRAS_ENV)
    if engine is SGLANG and (not extras or not Path(extras).is_dir()):
        return (
            f"{SGLANG_EXTRAS_ENV} is not set (SGLang's own HTTP server needs a few packages the "
            'scheduler venv lacks: eval "$(bash .ci/sglang-server-extras.sh)")'
        )
    return None


# -- which processes count -------------------------------------------------------------------


def _role(line: str, is_root: bool) -> str:
    """The front-end role of one process of a server's tree (not the engine's)."""
    if " -m smgd" in f" {line}" or "/smgd " in line:
        return "smgd"
    if "sglang_scheduler.py" in line or "vllm_engine.py" in line:
        return "launcher"  # a launcher process resident beside the engine
    if "sglang::detokenizer" in line:
        return "detokenizer"
    if is_root:
        return "server"  # SGLang's launch_server (HTTP + TokenizerManager), vLLM's API server
    return "other"


def classify(
    root: int, stats: Iterable[procstat.Stat], lines: Mapping[int, str], marks: Sequence[str]
) -> dict[str, list[int]]:
    """Split ``root``'s process tree into roles: ``engine`` and the front end's roles.

    ``lines`` maps pid to command line (NUL bytes as spaces). A process whose command line
    holds one of ``marks`` is an engine root; it and all its descendants are ``engine``.
    """
    stats = list(stats)
    tree = procstat.descendants(root, stats)
    engine: set[int] = set()
    for pid in tree:
        if pid not in engine and any(m in lines.get(pid, "") for m in marks):
            engine.update(procstat.descendants(pid, stats))
    roles: dict[str, list[int]] = {}
    for pid in tree:
        role = "engine" if pid in engine else _role(lines.get(pid, ""), pid == root)
        roles.setdefault(role, []).append(pid)
    return roles


def roles_of(root: int, marks: Sequence[str]) -> dict[str, list[int]]:
    """:func:`classify` on the live ``/proc``."""
    stats = procstat.all_stats()
    tree = procstat.descendants(root, stats)
    return classify(root, stats, {pid: cmdline(pid) for pid in tree}, marks)


def front_end(roles: Mapping[str, Sequence[int]]) -> list[int]:
    return sorted(pid for role, pids in roles.items() if role != "engine" for pid in pids)


def parse_rollup_kib(text: str, key: str) -> int:
    """A ``kB`` value of ``/proc/<pid>/smaps_rollup`` (``Pss``, ``Rss``); 0 when absent."""
    return procstat.parse_status_kib(text, key)


def memory_kib(pids: Iterable[int]) -> dict[str, int]:
    """Summed PSS and RSS of ``pids``: from ``smaps_rollup``, RSS alone where it is missing."""
    pss = rss = 0
    for pid in pids:
        try:
            text = (procstat.PROC / str(pid) / "smaps_rollup").read_text()
        except OSError:
            rss_only = procstat.rss_kib([pid])
            pss, rss = pss + rss_only, rss + rss_only
            continue
        pss += parse_rollup_kib(text, "Pss")
        rss += parse_rollup_kib(text, "Rss")
    return {"pss_kib": pss, "rss_kib": rss}


def footprint(roles: Mapping[str, Sequence[int]]) -> dict[str, dict[str, Any]]:
    """Per role: its pids, PSS and RSS (KiB)."""
    return {role: {"pids": list(pids), **memory_kib(pids)} for role, pids in roles.items()}


# -- the two sides -----------------------------------------------------------------------


def smgd_config(engine: RealEngine, *, python: str, model: str, port: int, run_dir: str) -> str:
    """smgd.toml: one engine of ``engine.wire`` that smgd launches with the target's flags."""
    lines = [
        f'run_dir = "{run_dir}"',
        "[server]",
        f"port = {port}",
        "[logging]",
        'level = "warning"',
        "[[engines]]",
        f'name = "{engine.wire}"',
        f'wire = "{engine.wire}"',
        f'models = ["{SERVED_NAME}"]',
        f'model_dir = "{model}"',
        "[engines.timeouts]",
        f"ready_s = {READY_TIMEOUT_S}",
        "[engines.launch]",
        f'kind = "{engine.wire}"',
        f'python = "{python}"',
        f"args = {json.dumps(smgd_launch_args(engine))}",
    ]
    return "\n".join(lines) + "\n"


def smgd_launch_args(engine: RealEngine) -> list[str]:
    if engine is SGLANG:
        return ["--cpu-shims", *engine.flags]
    return list(engine.flags)


def own_argv(engine: RealEngine, *, python: str, model: str, port: int) -> list[str]:
    """The engine's own OpenAI server on ``port``, with the same engine flags."""
    if engine is SGLANG:
        return [
            python, "-m", "sglang.launch_server",
            "--model-path", model,
            "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--log-level", "warning",
            *engine.flags,
        ]  # fmt: skip
    return [
        python, "-c", VLLM_CLI_SHIM, "serve", model,
        "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        # Not --disable-log-stats: that is an engine flag too (no SchedulerStats per step), and
        # smgd's launch keeps the stats on (it reads them); both engines must run the same.
        "--disable-uvicorn-access-log",
        *engine.flags,
    ]  # fmt: skip


def own_env(engine: RealEngine) -> dict[str, str]:
    if engine is SGLANG:
        # What --cpu-shims does for smgd's launcher: import-only stand-ins and the CPU engine.
        parts = (
            str(cpu_shims_dir()),
            os.environ.get(SGLANG_EXTRAS_ENV),
            os.environ.get("PYTHONPATH"),
        )
        path = os.pathsep.join(p for p in parts if p)
        return {"PYTHONPATH": path, "SGLANG_USE_CPU_ENGINE": "1"}
    return {"VLLM_LOGGING_LEVEL": "WARNING"}


@dataclass
class Side:
    """One server in front of the engine: smgd, or the engine's own."""

    name: str  # result key, e.g. "sglang-real/smgd"
    proc: Proc
    port: int
    marks: tuple[str, ...]

    def roles(self) -> dict[str, list[int]]:
        return roles_of(self.proc.pid, self.marks)

    def measured(self) -> Measured:
        def server() -> list[int]:
            return front_end(self.roles())

        def engine() -> list[int]:
            return self.roles().get("engine", [])

        return Measured(server, engine)


def prompt_ids(model: str, prompt_tokens: int) -> list[int]:
    """``prompt_tokens`` ids of plain English from the model's tokenizer, no special ids."""
    from smgd.bench.workload import _TEXT
    from smgd.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    ids: list[int] = []
    text = _TEXT
    while len(ids) < prompt_tokens:
        ids = [t for t in tok.encode(text, add_special_tokens=False) if t not in tok.special_ids]
        text += _TEXT
    return ids[:prompt_tokens]


def count_spec(
    *, port: int, ids: list[int], workload: Workload, concurrency: int, duration_s: float
) -> dict[str, Any]:
    """The loadgen's spec for one point on a real engine (``count`` mode, ``ignore_eos``)."""
    # A real engine's step is not known in advance (the tiny model on vLLM: ~2 ms; on SGLang
    # here: 100+ ms): bound the time by the duration plus a few whole requests at a pessimistic
    # 50 ms per step, and the count so loosely (1 ms per token) that the duration ends a point.
    request_s = workload.max_tokens * 0.05
    fastest_request_s = workload.max_tokens * 0.001
    return {
        "port": port,
        "model": SERVED_NAME,
        "prompt_ids": ids,
        "max_tokens": workload.max_tokens,
        "concurrency": concurrency,
        "duration_s": duration_s,
        "max_requests": concurrency * (math.ceil(duration_s / fastest_request_s) + 1),
        "time_limit_s": max(60.0, 3 * (duration_s + request_s)),
        "expected_text": "",
        "prefix_lens": [],
        "mode": "count",
        "new_connections": workload.new_connections,
    }


async def _point(side: Side, spec: dict[str, Any]) -> dict[str, Any]:
    result = await measure_http_point(spec, side.measured())
    # measure_http_point names the engine's share "mock"; here it is the real engine.
    result["engine_cpu_s"] = result["mock_cpu_s"]
    return result


async def _start_smgd(
    engine: RealEngine, python: str, model: str, run_dir: str, log_dir: Path
) -> Side:
    port = free_port()
    config = Path(run_dir) / "smgd.toml"
    config.write_text(smgd_config(engine, python=python, model=model, port=port, run_dir=run_dir))
    argv = [sys.executable, "-m", "smgd", "serve", "--config", str(config)]
    proc = await start(f"{engine.target}-smgd", argv, log_dir)
    return Side(f"{engine.target}/smgd", proc, port, engine.engine_marks)


async def _start_own(engine: RealEngine, python: str, model: str, log_dir: Path) -> Side:
    port = free_port()
    argv = own_argv(engine, python=python, model=model, port=port)
    proc = await start(f"{engine.target}-{engine.own}", argv, log_dir, env=own_env(engine))
    return Side(f"{engine.target}/{engine.own}", proc, port, engine.engine_marks)


_ROUND = dict.fromkeys(TARGETS, 0)  # how many runs of each target so far (orders alternate)


async def run_real(
    name: str, workload: Workload, concurrencies: Sequence[int], log_dir: Path
) -> dict[str, list[dict[str, Any]]]:
    """Both sides of one real-engine target; their points, keyed ``<target>/<side>``."""
    engine = ENGINES[name]
    python, model = os.environ[engine.python_env], os.environ[engine.model_env]
    ids = prompt_ids(model, workload.prompt_tokens)
    flip = _ROUND[name] % 2
    _ROUND[name] += 1
    with tempfile.TemporaryDirectory(prefix="smgdr-", dir="/tmp") as run_dir:
        sides: list[Side] = []
        try:
            # One at a time: two engines loading at once on 2 cores only slows both.
            sides.append(await _start_smgd(engine, python, model, run_dir, log_dir))
            await wait_ready(sides[0].proc, sides[0].port, "/readiness", READY_TIMEOUT_S)
            sides.append(await _start_own(engine, python, model, log_dir))
            await wait_ready(sides[1].proc, sides[1].port, "/health", READY_TIMEOUT_S)
            results: dict[str, list[dict[str, Any]]] = {s.name: [] for s in sides}
            for side in sides:
                warm = count_spec(
                    port=side.port,
                    ids=ids,
                    workload=workload,
                    concurrency=WARMUP_CONCURRENCY,
                    duration_s=WARMUP_S,
                )
                await measure_http_point(warm, side.measured())
            idle = {s.name: footprint(s.roles()) for s in sides}
            for i, c in enumerate(concurrencies):
                order = sides if (i + flip) % 2 == 0 else sides[::-1]
                for side in order:
                    log.info("%s C=%d", side.name, c)
                    spec = count_spec(
                        port=side.port,
                        ids=ids,
                        workload=workload,
                        concurrency=c,
                        duration_s=workload.duration_s,
                    )
                    point = await _point(side, spec)
                    point["roles_idle"] = idle[side.name]
                    point["frontend_idle_pss_kib"] = _sum_front(idle[side.name], "pss_kib")
                    point["frontend_idle_rss_kib"] = _sum_front(idle[side.name], "rss_kib")
                    point["measured_first"] = side is order[0]
                    results[side.name].append(point)
            return results
        finally:
            for side in reversed(sides):
                await side.proc.stop()


def _sum_front(roles: Mapping[str, Mapping[str, Any]], key: str) -> int:
    return sum(int(v[key]) for role, v in roles.items() if role != "engine")


# -- figures ---------------------------------------------------------------------------------


def derive(point: Mapping[str, Any], workload: Workload) -> dict[str, Any]:
    """The report's figures for one real-engine point, without the mock's step-based ones."""
    out = report.derive({**point, "mock_cpu_s": point["engine_cpu_s"]}, workload)
    for key in (
        "offered_tokens_per_s",
        "delivered_fraction",
        "mock_bottleneck",
        "ttft_p50_over_step_ms",
        "ttft_p99_over_step_ms",
        "itl_p50_over_step_ms",
        "itl_p99_over_step_ms",
    ):
        out[key] = None
    out["engine_cores"] = out["mock_cores"]
    out["frontend_idle_pss_mib"] = round(point["frontend_idle_pss_kib"] / 1024.0, 1)
    out["frontend_idle_rss_mib"] = round(point["frontend_idle_rss_kib"] / 1024.0, 1)
    return out


def _pairs(targets: Mapping[str, Any]) -> list[tuple[str, str]]:
    out = []
    for engine in ENGINES.values():
        mine, theirs = f"{engine.target}/smgd", f"{engine.target}/{engine.own}"
        if mine in targets and theirs in targets:
            out.append((mine, theirs))
    return out


def _ratio(a: Any, b: Any, digits: int = 3) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return round(float(a) / float(b), digits)


def ratios(targets: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """smgd vs the engine's own server at equal concurrency, in the report's ratio shape, plus
    the front ends' idle PSS."""
    rows: list[dict[str, Any]] = []
    for mine, theirs in _pairs(targets):
        by_c = {p["concurrency"]: p for p in targets[theirs]}
        for s in targets[mine]:
            p = by_c.get(s["concurrency"])
            if p is None:
                continue
            rows.append(
                {
                    "target": mine,
                    "concurrency": s["concurrency"],
                    "vs": theirs,
                    "cpu_per_token": _ratio(s["cpu_us_per_token"], p["cpu_us_per_token"], 2),
                    "tokens_per_s": _ratio(s["tokens_per_s"], p["tokens_per_s"]),
                    "ttft_p50_delta_ms": (
                        round(s["ttft_p50_ms"] - p["ttft_p50_ms"], 2)
                        if s["ttft_p50_ms"] is not None and p["ttft_p50_ms"] is not None
                        else None
                    ),
                    "frontend_pss": _ratio(s["frontend_idle_pss_mib"], p["frontend_idle_pss_mib"]),
                }
            )
    return rows


def memory_table(targets: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """Markdown: each real side's front-end roles at idle (after the warm-up), PSS and RSS."""
    lines = [
        "| side | role | pids | PSS MiB | RSS MiB |",
        "|---|---|---|---|---|",
    ]
    for name, points in targets.items():
        if not points or "roles_idle" not in points[0]:
            continue
        for role, v in sorted(points[0]["roles_idle"].items()):
            lines.append(
                f"| {name} | {role} | {len(v['pids'])} | {v['pss_kib'] / 1024:.1f} | "
                f"{v['rss_kib'] / 1024:.1f} |"
            )
    return "\n".join(lines) if len(lines) > 2 else ""

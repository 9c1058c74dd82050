"""``smgd bench``: smgd vs a raw ZMQ floor vs vLLM's front end, on the same mock engine.

For each target and each concurrency C, C streaming completions (P prompt tokens, M output
tokens, ``include_usage``) are kept in flight for a fixed duration by the load generator
process; the figures per point (see :mod:`smgd.bench.report`) go to ``OUT/bench.json``, a
table on stdout and ``OUT/bench.png``. Loopback only; every point is bounded in requests and
time. ``--quick`` is a ~30 s smoke run.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from smgd.bench import real, report
from smgd.bench.workload import VOCABS, Workload

if TYPE_CHECKING:
    from collections.abc import Awaitable

log = logging.getLogger("smgd.bench")

DEFAULT_TARGETS = ("smgd", "floor", "vllm")
# floor-sse: the floor writing each delivery to a loopback TCP client as one SSE chunk: the
# least any front end spends per token, its write included. On request only (one more mock).
# smgd-flat: smgd with adaptive coalescing off (server.coalesce_max_ms = 0), every token its
# own event: the baseline that shows, in one run, what coalescing buys under load. On request
# only: at the default points the loop is rarely saturated, and it would add a minute.
# smgd-tools: the tools workload (a reasoning block and a hermes call parsed into
# reasoning_content and tool_calls): what parsing costs per token beside plain `smgd`;
# smgd-tools-noparse: the same requests and reply on an engine without parsers (the control).
# sglang-real, vllm-real: smgd vs the engine's own server on a REAL engine (smgd.bench.real);
# on request only: each starts two servers and two engines (minutes on this machine).
TARGETS = (
    *DEFAULT_TARGETS,
    "floor-sse",
    "smgd-flat",
    "smgd-tools",
    "smgd-tools-noparse",
    "sglang-real",
    "vllm-real",
)
DEFAULT_CONCURRENCY = "1,16,64,256,1024"
# --quick: three small points of 3 s with short outputs, about 30 s with both start-ups.
QUICK_CONCURRENCY = "1,16,64"
QUICK_DURATION_S = 3.0
QUICK_MAX_TOKENS = 32
DEFAULT_DURATION_S = 10.0  # several request lifetimes (M=128 at 20 ms = 2.56 s) per point
DEFAULT_MAX_TOKENS = 128


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("expected positive integers, e.g. 1,16,64")
    return values


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError("expected a positive integer")
    return value


# `smgd-wN`: smgd with server.workers = N (2..8), one mock engine per worker.
_WORKERS_TARGET = re.compile(r"smgd-w([2-8])")


def _targets(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in TARGETS and not _WORKERS_TARGET.fullmatch(t)]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown target(s) {bad}; choose from {TARGETS} or smgd-w2..smgd-w8"
        )
    return names


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench-out", help="output directory (default bench-out/)")
    parser.add_argument(
        "--concurrency",
        type=_ints,
        default=None,
        help=f"comma-separated stream counts (default {DEFAULT_CONCURRENCY})",
    )
    parser.add_argument(
        "--targets",
        type=_targets,
        default=list(DEFAULT_TARGETS),
        help="comma-separated subset of smgd,smgd-flat,smgd-tools,smgd-tools-noparse,floor,"
        "floor-sse,vllm,sglang-real,vllm-real, plus smgd-wN (N = 2..8 workers)",
    )
    parser.add_argument("--step-ms", type=float, default=20.0, help="mock engine step time")
    parser.add_argument("--max-batch", type=int, default=256, help="mock engine running batch")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="P: prompt length")
    parser.add_argument("--max-tokens", type=int, default=None, help="M: output tokens (128)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per point (10)")
    parser.add_argument(
        "--quick", action="store_true", help="~30 s smoke run: C=1,16,64, 3 s, M=32"
    )
    parser.add_argument(
        "--rounds",
        type=_count,
        default=1,
        help="run every target N times, alternating their order, and report medians (1)",
    )
    parser.add_argument(
        "--vocab",
        choices=VOCABS,
        default="tiny",
        help="tokenizer: the packaged 1k-token one (tiny), or a 128k-token byte-level BPE "
        "built offline on first use (~20 s) with real multilingual text as the prompt",
    )
    parser.add_argument(
        "--new-connections",
        action="store_true",
        help="a new connection for every request (a client without a pool), TTFT from the "
        "connect; default: keep-alive connections opened before the clock starts",
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")


def workload_from_args(args: argparse.Namespace) -> tuple[Workload, list[int]]:
    quick = bool(args.quick)
    conc: list[int] = args.concurrency or _ints(QUICK_CONCURRENCY if quick else DEFAULT_CONCURRENCY)
    duration: float = args.duration
    if duration is None:
        duration = QUICK_DURATION_S if quick else DEFAULT_DURATION_S
    max_tokens: int = args.max_tokens
    if max_tokens is None:
        max_tokens = QUICK_MAX_TOKENS if quick else DEFAULT_MAX_TOKENS
    workload = Workload(
        step_ms=args.step_ms,
        max_batch=args.max_batch,
        prompt_tokens=args.prompt_tokens,
        max_tokens=max_tokens,
        duration_s=duration,
        vocab=args.vocab,
        new_connections=args.new_connections,
    )
    return workload, conc


_FAILURES = (RuntimeError, OSError, trio.TooSlowError, msgspec.DecodeError)


def _first_failure(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


async def _guarded(
    work: Awaitable[list[dict[str, Any]]], name: str, failed: dict[str, str]
) -> list[dict[str, Any]] | None:
    """Run one target; a failure (even inside a nursery) is recorded, the others still run."""
    try:
        return await work
    except* _FAILURES as group:
        exc = _first_failure(group)
        failed[name] = f"{type(exc).__name__}: {exc}"
    return None


async def _guarded_real(
    work: Awaitable[dict[str, list[dict[str, Any]]]], name: str, failed: dict[str, str]
) -> dict[str, list[dict[str, Any]]] | None:
    """:func:`_guarded` for a real-engine target (its points come keyed by side)."""
    try:
        return await work
    except* _FAILURES as group:
        exc = _first_failure(group)
        failed[name] = f"{type(exc).__name__}: {exc}"
    return None


async def run_all(
    workload: Workload, conc: list[int], targets: list[str], out: Path
) -> dict[str, Any]:
    from smgd.bench import targets as t
    from smgd.bench import vllm_frontend

    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {}
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    for name in targets:
        if name == "vllm" and (why := vllm_frontend.unavailable()) is not None:
            skipped[name] = why
            continue
        if name in real.ENGINES:
            if (why := real.unavailable(real.ENGINES[name])) is not None:
                skipped[name] = why
                continue
            print(f"smgd bench: {name} …", file=sys.stderr, flush=True)
            sides = await _guarded_real(real.run_real(name, workload, conc, log_dir), name, failed)
            for side, measured in (sides or {}).items():
                results[side] = [real.derive(p, workload) for p in measured]
            continue
        print(f"smgd bench: {name} …", file=sys.stderr, flush=True)
        if match := _WORKERS_TARGET.fullmatch(name):
            work = t.run_smgd(workload, conc, log_dir, workers=int(match.group(1)))
        elif name == "smgd-flat":
            work = t.run_smgd(workload, conc, log_dir, coalesce=False)
        elif name == "smgd-tools":
            work = t.run_smgd(workload, conc, log_dir, tools=True)
        elif name == "smgd-tools-noparse":
            work = t.run_smgd(workload, conc, log_dir, tools=True, parsers=False)
        elif name in ("floor", "floor-sse"):
            work = t.run_floor(workload, conc, log_dir, sse=name == "floor-sse")
        elif name == "vllm":
            work = vllm_frontend.run_vllm(workload, conc, log_dir)
        else:
            work = t.run_smgd(workload, conc, log_dir)
        points = await _guarded(work, name, failed)
        if points is not None:
            results[name] = [report.derive(p, workload) for p in points]
    return {"results": results, "skipped": skipped, "failed": failed}


def bench_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    workload, conc = workload_from_args(args)
    rounds: int = args.rounds
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    runs = []
    for i in range(rounds):
        # Every other round in reverse order: a slow stretch of a noisy machine then falls on
        # each target as often, instead of always on whichever runs second.
        order = list(args.targets) if i % 2 == 0 else list(reversed(args.targets))
        run = trio.run(
            run_all, workload, conc, order, out if rounds == 1 else out / f"round-{i + 1}"
        )
        run["ratios"] = report.ratios(run["results"]) + real.ratios(run["results"])
        runs.append(run)
    first = runs[0]
    doc: dict[str, Any] = {
        "workload": dataclasses.asdict(workload),
        "concurrency": conc,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "started_unix": round(started, 1),
        "duration_s": round(time.time() - started, 1),
        "targets": first["results"],
        "skipped": first["skipped"],
        "failed": first["failed"],
        "ratios": first["ratios"],
    }
    if rounds > 1:
        doc["rounds"] = [{"targets": r["results"], "ratios": r["ratios"]} for r in runs]
        doc["summary"] = report.round_summary(doc["rounds"])
    (out / "bench.json").write_bytes(msgspec.json.format(msgspec.json.encode(doc), indent=2))
    for i, run in enumerate(runs):
        if rounds > 1:
            print(f"round {i + 1} of {rounds}")
        print(report.table(run["results"]))
        print()
        print(report.ratio_table(run["ratios"]))
        print()
        if memory := real.memory_table(run["results"]):
            print(memory)
            print()
    if rounds > 1:
        print(f"median (min-max) over {rounds} rounds")
        print(report.summary_table(doc["summary"]))
        print()
    failed = {name: why for run in runs for name, why in run["failed"].items()}
    for name, why in {**first["skipped"], **failed}.items():
        print(f"{name}: not measured: {why}")
    if not args.no_plot:
        png = out / "bench.png"
        if report.plot(first["results"], workload, png):
            print(f"plot: {png}")
        else:
            print("plot: skipped (matplotlib is not installed: pip install 'smgd[bench]')")
    print(f"json: {out / 'bench.json'}")
    bad = any(
        p["lost_tokens"] or p["duplicated_tokens"] or p["requests_failed"]
        for run in runs
        for points in run["results"].values()
        for p in points
    )
    return 1 if bad or failed else 0

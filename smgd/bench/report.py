"""Turn raw point results into the benchmark's figures, a text table, ratios and a PNG plot.

:func:`derive` is pure: it adds the derived figures (CPU µs per output token, delivered vs
offered, overheads over the engine step, RSS per in-flight stream, the mock's CPU share) to
one point's raw numbers. :func:`ratios` compares smgd against the floor and vLLM at equal
concurrency. The plot needs matplotlib (the ``bench`` extra) and is skipped without it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from smgd.bench import procstat

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from pathlib import Path

    from smgd.bench.workload import Workload

# The mock must never be the bottleneck: above this share of one core its own step loop could
# fall behind the nominal step time and the point would measure the mock, not the front end.
MOCK_CPU_LIMIT = 0.5


def _div(a: float, b: float) -> float:
    return a / b if b else math.nan


def _r(x: float, digits: int = 1) -> float | None:
    return None if x is None or math.isnan(x) else round(x, digits)


def derive(point: Mapping[str, Any], workload: Workload) -> dict[str, Any]:
    c = int(point["concurrency"])
    out = dict(point)
    # A several-worker target runs one full-batch mock engine per worker (`engines`).
    engines = int(point.get("engines", 1))
    offered = min(c, workload.max_batch * engines) * 1000.0 / workload.step_ms
    tokens = float(point["output_tokens"])
    out["offered_tokens_per_s"] = round(offered, 1)
    out["delivered_fraction"] = _r(_div(float(point["tokens_per_s"]), offered), 3)
    out["cpu_us_per_token"] = _r(_div(float(point["server_cpu_s"]) * 1e6, tokens))
    # The figure's resolution: 1 ns where every thread's schedstat was read, else a clock
    # tick (10 ms at USER_HZ=100), where a light point can read 0 (procstat's docstring).
    grain_s = float(point.get("server_cpu_grain_s", 1 / procstat.CLOCK_TICKS))
    out["cpu_grain_us_per_token"] = _r(_div(grain_s * 1e6, tokens), 9)
    # Per SSE event (or per delivery for the floor): unlike per token, this does not drop when
    # a loaded server coalesces several tokens into one event.
    out["cpu_us_per_chunk"] = _r(
        _div(float(point["server_cpu_s"]) * 1e6, float(point.get("chunks", 0)))
    )
    out["server_cores"] = _r(_div(float(point["server_cpu_s"]), float(point["elapsed_s"])), 3)
    out["mock_cores"] = _r(_div(float(point["mock_cpu_s"]), float(point["elapsed_s"])), 3)
    if "loadgen_cpu_s" in point:
        out["loadgen_cores"] = _r(_div(float(point["loadgen_cpu_s"]), float(point["elapsed_s"])), 3)
    out["mock_bottleneck"] = bool(
        out["mock_cores"] is not None and out["mock_cores"] > MOCK_CPU_LIMIT
    )
    for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
        value = point.get(key)
        out[key.replace("_ms", "_over_step_ms")] = (
            None if value is None else round(float(value) - workload.step_ms, 2)
        )
    if "peak_rss_kib" in point:
        out["peak_rss_mib"] = round(point["peak_rss_kib"] / 1024.0, 1)
        grown = point["peak_rss_kib"] - point.get("idle_rss_kib", point["peak_rss_kib"])
        out["rss_per_stream_kib"] = round(max(0, grown) / c, 1)
    return out


def _is_smgd(name: str) -> bool:
    return name in ("smgd", "smgd-tools", "smgd-tools-noparse") or name.startswith("smgd-w")


def _baselines(name: str) -> list[str]:
    if name == "smgd":
        return ["floor", "floor-sse", "vllm", "smgd-flat"]
    if name == "smgd-tools":
        return ["floor", "floor-sse", "vllm", "smgd", "smgd-tools-noparse"]
    return ["floor", "floor-sse", "vllm", "smgd"]


def ratios(targets: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Each smgd target vs each baseline at equal concurrency: CPU per token, tok/s, TTFT p50.

    Baselines are the floors (``floor``, ``floor-sse``) and vLLM; for a several-worker target
    (``smgd-wN``) and the tools workload (``smgd-tools``, ``smgd-tools-noparse``) also the
    plain one-process ``smgd`` of the same run, for ``smgd-tools`` also its control without
    parsers (``smgd-tools-noparse``), and for ``smgd`` the same with coalescing off
    (``smgd-flat``).
    """
    out: list[dict[str, Any]] = []
    for name, points in targets.items():
        if not _is_smgd(name):
            continue
        mine = {p["concurrency"]: p for p in points}
        for base in _baselines(name):
            for p in targets.get(base, []):
                s = mine.get(p["concurrency"])
                if s is None:
                    continue
                row: dict[str, Any] = {"concurrency": p["concurrency"], "vs": base}
                if name != "smgd":
                    row["target"] = name
                row["cpu_per_token"] = _r(
                    _div(s["cpu_us_per_token"] or math.nan, p["cpu_us_per_token"] or math.nan), 2
                )
                row["tokens_per_s"] = _r(_div(s["tokens_per_s"], p["tokens_per_s"]), 3)
                row["ttft_p50_delta_ms"] = (
                    _r(s["ttft_p50_ms"] - p["ttft_p50_ms"], 2)
                    if s["ttft_p50_ms"] is not None and p["ttft_p50_ms"] is not None
                    else None
                )
                out.append(row)
    return out


_COLUMNS = (
    ("target", "target", "{}"),
    ("C", "concurrency", "{}"),
    ("tok/s", "tokens_per_s", "{:.0f}"),
    ("offered", "offered_tokens_per_s", "{:.0f}"),
    ("TTFT p50", "ttft_p50_ms", "{:.1f}"),
    ("p99", "ttft_p99_ms", "{:.1f}"),
    ("ITL p50", "itl_p50_ms", "{:.1f}"),
    ("p99", "itl_p99_ms", "{:.1f}"),
    ("CPU µs/tok", "cpu_us_per_token", "{:.1f}"),
    ("µs/chunk", "cpu_us_per_chunk", "{:.1f}"),
    ("cores", "server_cores", "{:.2f}"),
    ("mock cores", "mock_cores", "{:.2f}"),
    ("RSS MiB", "peak_rss_mib", "{:.1f}"),
    ("KiB/stream", "rss_per_stream_kib", "{:.1f}"),
    ("tok/chunk", "tokens_per_chunk", "{:.2f}"),
    ("lost", "lost_tokens", "{}"),
    ("dup", "duplicated_tokens", "{}"),
    ("failed", "requests_failed", "{}"),
    ("client cores", "loadgen_cores", "{:.2f}"),
    ("conn max ms", "connect_max_ms", "{:.0f}"),
    ("load 1m", "loadavg_1m", "{:.1f}"),
)


# Figures summarised over rounds (--rounds): per point, the median and the range of each.
_ROUND_FIGURES = ("delivered_fraction", "ttft_p50_ms", "itl_p99_ms", "cpu_us_per_token")
_RATIO_FIGURES = ("cpu_per_token", "tokens_per_s", "ttft_p50_delta_ms")


def _spread(values: Sequence[float | None]) -> dict[str, Any] | None:
    """Median, min and max of the measured values (None where a round had none)."""
    have = sorted(v for v in values if v is not None and not math.isnan(v))
    if not have:
        return None
    mid = len(have) // 2
    median = have[mid] if len(have) % 2 else (have[mid - 1] + have[mid]) / 2
    return {"median": round(median, 3), "min": have[0], "max": have[-1], "n": len(have)}


def round_summary(
    rounds: Sequence[Mapping[str, Any]],
) -> dict[str, list[dict[str, Any]]]:
    """Each point and each ratio over several rounds of the same run: median and range.

    ``rounds`` holds each round's ``{"targets": ..., "ratios": ...}``. On a noisy machine one
    round's ratio moves with whatever else ran at that moment; the median of rounds that
    alternate the targets' order does much less. Lost, duplicated and failed are summed.
    """
    points: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for rnd in rounds:
        for name, measured in rnd["targets"].items():
            for p in measured:
                points.setdefault((name, int(p["concurrency"])), []).append(p)
    point_rows = []
    for (name, c), seen in points.items():
        row: dict[str, Any] = {"target": name, "concurrency": c, "rounds": len(seen)}
        for key in _ROUND_FIGURES:
            row[key] = _spread([p.get(key) for p in seen])
        for key in ("lost_tokens", "duplicated_tokens", "requests_failed"):
            row[key] = sum(int(p.get(key, 0)) for p in seen)
        point_rows.append(row)
    ratios_seen: dict[tuple[str, int, str], list[Mapping[str, Any]]] = {}
    for rnd in rounds:
        for r in rnd["ratios"]:
            pair = (r.get("target", "smgd"), int(r["concurrency"]), r["vs"])
            ratios_seen.setdefault(pair, []).append(r)
    ratio_rows = []
    for (name, c, vs), seen in ratios_seen.items():
        ratio: dict[str, Any] = {"target": name, "concurrency": c, "vs": vs}
        for key in _RATIO_FIGURES:
            ratio[key] = _spread([r.get(key) for r in seen])
        ratio_rows.append(ratio)
    return {"points": point_rows, "ratios": ratio_rows}


def _range_cell(fmt: str, spread: Mapping[str, Any] | None, scale: float = 1.0) -> str:
    if spread is None:
        return "-"
    median, low, high = (spread[k] * scale for k in ("median", "min", "max"))
    return f"{fmt.format(median)} ({fmt.format(low)}-{fmt.format(high)})"


def summary_table(summary: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """Markdown tables of :func:`round_summary`: median (min-max) over the rounds."""
    lines = [
        "| target | C | rounds | delivered % | TTFT p50 ms | ITL p99 ms | CPU µs/tok | lost | dup "
        "| failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in summary["points"]:
        lines.append(
            f"| {p['target']} | {p['concurrency']} | {p['rounds']} | "
            f"{_range_cell('{:.1f}', p['delivered_fraction'], 100)} | "
            f"{_range_cell('{:.0f}', p['ttft_p50_ms'])} | "
            f"{_range_cell('{:.1f}', p['itl_p99_ms'])} | "
            f"{_range_cell('{:.1f}', p['cpu_us_per_token'])} | {p['lost_tokens']} | "
            f"{p['duplicated_tokens']} | {p['requests_failed']} |"
        )
    if summary["ratios"]:
        lines += [
            "",
            "| target | C | vs | CPU per token | tok/s | TTFT p50 delta ms |",
            "|---|---|---|---|---|---|",
        ]
        for r in summary["ratios"]:
            lines.append(
                f"| {r['target']} | {r['concurrency']} | {r['vs']} | "
                f"{_range_cell('{:.2f}', r['cpu_per_token'])} | "
                f"{_range_cell('{:.3f}', r['tokens_per_s'])} | "
                f"{_range_cell('{:.0f}', r['ttft_p50_delta_ms'])} |"
            )
    return "\n".join(lines)


def _cell(fmt: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def table(targets: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """A fixed-width text table (also valid Markdown) of every target's points."""
    rows = [[name for name, _, _ in _COLUMNS]]
    for target, points in targets.items():
        for p in points:
            row = {**p, "target": target}
            rows.append([_cell(fmt, row.get(key)) for _, key, fmt in _COLUMNS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = [
        "| " + " | ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) + " |"
        for r in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def ratio_table(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "(no baseline measured)"
    lines = [
        "| target | C | vs | target/base CPU per token | target/base tok/s | TTFT p50 delta ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.get('target', 'smgd')} | {r['concurrency']} | {r['vs']} | "
            f"{_cell('{:.2f}', r['cpu_per_token'])} | {_cell('{:.3f}', r['tokens_per_s'])} | "
            f"{_cell('{:.1f}', r['ttft_p50_delta_ms'])} |"
        )
    return "\n".join(lines)


def plot(
    targets: Mapping[str, Sequence[Mapping[str, Any]]], workload: Workload, path: Path
) -> bool:
    """tokens/s and CPU µs per token against concurrency; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    cs: set[int] = set()
    for target, points in targets.items():
        if not points:
            continue
        xs = [p["concurrency"] for p in points]
        cs.update(xs)
        ax1.plot(xs, [p["tokens_per_s"] for p in points], marker="o", label=target)
        ax2.plot(xs, [p["cpu_us_per_token"] for p in points], marker="o", label=target)
    xs = sorted(cs)
    ax1.plot(xs, [workload.offered_tokens_per_s(c) for c in xs], "k--", label="offered")
    ax1.set(
        xscale="log",
        yscale="log",
        xlabel="concurrent streams",
        ylabel="output tokens/s",
        title="delivered tokens/s",
    )
    ax2.set(
        xscale="log",
        yscale="log",
        xlabel="concurrent streams",
        ylabel="CPU µs per output token",
        title="front-end CPU per token",
    )
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"mock engine {workload.step_ms:g} ms/step, batch {workload.max_batch}, "
        f"P={workload.prompt_tokens}, M={workload.max_tokens}"
        + (", a connection per request" if workload.new_connections else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True

"""smgd bench: /proc parsing, stats, the SSE client parser, the loadgen against a fake server,
the report's derived figures, and (slow) a real ``smgd bench --quick`` run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from smgd.assets import TINY_MODEL_DIR
from smgd.bench import loadgen, procstat, report
from smgd.bench.floor import EVENT, FloorRun, FloorSpec, SseClients
from smgd.bench.loadgen import Spec, SSEParser
from smgd.bench.stats import percentile, prefix_lengths, token_errors
from smgd.bench.workload import Workload, build_prompt

REPO = Path(__file__).resolve().parent.parent

# --- procstat ---------------------------------------------------------------------------


def test_parse_stat_handles_spaces_and_parens_in_the_command_name() -> None:
    line = "4242 (my (odd) proc) S 17 4242 4242 0 -1 4194560 100 0 0 0 250 31 0 0 20 0 1 0"
    st_ = procstat.parse_stat(line)
    assert (st_.pid, st_.ppid, st_.utime, st_.stime) == (4242, 17, 250, 31)


def test_parse_status_kib_reads_the_key_and_defaults_to_zero() -> None:
    text = "Name:\tpython\nVmHWM:\t  81736 kB\nVmRSS:\t   71580 kB\n"
    assert procstat.parse_status_kib(text, "VmRSS") == 71580
    assert procstat.parse_status_kib(text, "VmHWM") == 81736
    assert procstat.parse_status_kib(text, "VmSwap") == 0


def test_descendants_walks_the_whole_tree_only() -> None:
    stats = [
        procstat.Stat(pid, ppid, 0, 0)
        for pid, ppid in [(1, 0), (10, 1), (11, 10), (12, 11), (20, 1), (13, 10)]
    ]
    assert sorted(procstat.descendants(10, stats)) == [10, 11, 12, 13]
    assert procstat.descendants(12, stats) == [12]


def test_cpu_of_this_process_grows_with_work_to_the_nanosecond() -> None:
    before = procstat.cpu_sample([os.getpid()])
    start = time.process_time()
    x = 0
    while time.process_time() - start < 0.05:
        x += 1
    spent = time.process_time() - start
    delta = procstat.cpu_between(before, procstat.cpu_sample([os.getpid()]))
    assert delta.grain_s == 1e-9  # every thread was read to the nanosecond
    assert spent <= delta.seconds <= spent + 0.02
    assert procstat.rss_kib([os.getpid()]) > 1000


def _sample(ticks: dict[int, int], threads: dict[int, dict[int, int]]) -> procstat.CpuSample:
    return procstat.CpuSample(ticks, threads)


def test_cpu_between_falls_back_to_ticks_where_nanoseconds_are_incomplete() -> None:
    tick = 1 / procstat.CLOCK_TICKS
    before = _sample({1: 10, 2: 10, 3: 5}, {1: {1: 100, 11: 50}, 2: {2: 100, 21: 900}, 3: {3: 7}})
    # 1: both threads still there -> nanoseconds. 2: thread 21 exited (its time is only in the
    # ticks). 4: new -> its ticks, whole. 3: gone -> nothing.
    after = _sample({1: 11, 2: 12, 4: 3}, {1: {1: 400, 11: 60, 12: 5}, 2: {2: 200}, 4: {4: 9}})
    delta = procstat.cpu_between(before, after)
    assert delta.seconds == pytest.approx(315e-9 + 2 * tick + 3 * tick)
    assert delta.grain_s == tick
    only_ns = procstat.cpu_between(_sample({1: 10}, {1: {1: 100}}), _sample({1: 10}, {1: {1: 350}}))
    assert only_ns == procstat.CpuDelta(250e-9, 1e-9)
    # No schedstat in this kernel (no threads read): ticks.
    assert procstat.cpu_between(_sample({1: 10}, {1: {}}), _sample({1: 13}, {1: {}})).seconds == (
        pytest.approx(3 * tick)
    )


def test_parse_schedstat() -> None:
    assert procstat.parse_schedstat("227980068 39535284 1069\n") == 227980068


# --- stats --------------------------------------------------------------------------------


def test_percentile_interpolates() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


PIECES = ["The", " quick", " brown", " fox", " jumps"]
EXPECTED = "".join(PIECES)
LENS = prefix_lengths(PIECES)


def test_token_errors_exact_stream_is_clean() -> None:
    assert token_errors(EXPECTED, EXPECTED, LENS) == (0, 0, False)


def test_token_errors_counts_a_lost_token() -> None:
    lost, dup, corrupt = token_errors("The quick fox jumps", EXPECTED, LENS)
    assert corrupt
    assert lost >= 1
    assert dup == 0


def test_token_errors_counts_a_duplicated_token() -> None:
    lost, dup, corrupt = token_errors("The quick quick brown fox jumps", EXPECTED, LENS)
    assert corrupt
    assert dup >= 1
    assert lost == 0


def test_token_errors_truncated_stream_loses_the_tail() -> None:
    assert token_errors("The quick", EXPECTED, LENS) == (3, 0, True)


# --- SSE parser ---------------------------------------------------------------------------


def _chunked_response(events: list[bytes]) -> bytes:
    head = b"HTTP/1.1 200 \r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = b""
    for ev in events:
        body += f"{len(ev):x}\r\n".encode() + ev + b"\r\n"
    return head + body + b"0\r\n\r\n"


@given(st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30))
def test_sse_parser_is_independent_of_how_bytes_are_split(cuts: list[int]) -> None:
    events = [b'data: {"n":%d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]
    raw = _chunked_response(events)
    parser = SSEParser()
    got: list[bytes] = []
    pos = 0
    for cut in cuts:
        got += parser.feed(raw[pos : pos + cut])
        pos += cut
    got += parser.feed(raw[pos:])
    assert got == [b'{"n":%d}' % i for i in range(5)] + [b"[DONE]"]
    assert parser.done
    assert parser.status == 200


def test_sse_parser_keeps_a_plain_error_body() -> None:
    body = b'{"error":{"message":"bad"}}'
    raw = b"HTTP/1.1 400 Bad\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(
        body
    )
    parser = SSEParser()
    assert parser.feed(raw + body) == []
    assert parser.done
    assert parser.status == 400
    assert bytes(parser.body) == body


# --- loadgen against a fake SSE server ---------------------------------------------------


def _event(text: str) -> bytes:
    return b'data: {"choices":[{"index":0,"text":%s}]}\n\n' % json.dumps(text).encode()


async def _fake_server(
    pieces: list[str],
    usage: int,
    listeners: list[trio.SocketListener],
    connections: list[None] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    async def handle(stream: trio.SocketStream) -> None:
        if connections is not None:
            connections.append(None)
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                data = await stream.receive_some(65536)
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            while len(buf) < length:
                buf += await stream.receive_some(65536)
            buf = buf[length:]
            events = [_event(p) for p in pieces]
            events.append(b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\n' % usage)
            events.append(b"data: [DONE]\n\n")
            await stream.send_all(
                b"HTTP/1.1 200 \r\ncontent-type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            for ev in events:
                await trio.sleep(0.02)  # one "engine step" between events
                await stream.send_all(f"{len(ev):x}\r\n".encode() + ev + b"\r\n")
            await stream.send_all(b"0\r\n\r\n")

    async with trio.open_nursery() as nursery:
        got = await nursery.start(trio.serve_tcp, handle, 0)
        listeners.extend(got)
        task_status.started(got[0].socket.getsockname()[1])


def _spec(port: int, m: int, concurrency: int) -> Spec:
    expected_pieces = [PIECES[i % len(PIECES)] for i in range(m)]
    return Spec(
        port=port,
        model="x",
        prompt_ids=[1, 2, 3],
        max_tokens=m,
        concurrency=concurrency,
        duration_s=0.5,
        max_requests=2 * concurrency,
        time_limit_s=20.0,
        expected_text="".join(expected_pieces),
        prefix_lens=prefix_lengths(expected_pieces),
    )


# The loadgen is a blocking epoll loop on the real clock: it runs in a thread beside the fake
# server, and the fake's 20 ms "steps" are real (each test takes about a second).


@pytest.mark.parametrize(("drop", "lost"), [(False, 0), (True, 1)])
async def test_loadgen_counts_streams_and_lost_tokens(drop: bool, lost: int) -> None:
    m = 8
    pieces = [PIECES[i % len(PIECES)] for i in range(m)]
    sent = pieces[:3] + pieces[4:] if drop else pieces
    listeners: list[trio.SocketListener] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_fake_server, sent, m, listeners)
        summary = await trio.to_thread.run_sync(loadgen.run, _spec(port, m, 2))
        nursery.cancel_scope.cancel()
    assert summary["requests_completed"] == summary["requests_started"] >= 2
    assert summary["requests_failed"] == 0
    assert summary["output_tokens"] == m * summary["requests_completed"]
    assert summary["bad_streams"] == (summary["requests_completed"] if drop else 0)
    assert summary["lost_tokens"] >= lost * summary["requests_completed"]
    assert summary["ttft_p50_ms"] >= 15.0  # the fake waits one 20 ms "step" first
    assert 15.0 <= summary["itl_p50_ms"] <= 200.0


@pytest.mark.parametrize("new_connections", [False, True])
async def test_loadgen_opens_a_connection_per_request_only_when_asked(
    new_connections: bool,
) -> None:
    m = 4
    pieces = [PIECES[i % len(PIECES)] for i in range(m)]
    listeners: list[trio.SocketListener] = []
    connections: list[None] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_fake_server, pieces, m, listeners, connections)
        spec = _spec(port, m, 1)
        spec.duration_s, spec.max_requests = 10.0, 3
        spec.new_connections = new_connections
        summary = await trio.to_thread.run_sync(loadgen.run, spec)
        nursery.cancel_scope.cancel()
    assert summary["requests_completed"] == 3
    assert summary["requests_failed"] == summary["lost_tokens"] == 0
    assert len(connections) == (3 if new_connections else 1)


async def test_loadgen_reports_short_usage_as_lost() -> None:
    m = 8
    pieces = [PIECES[i % len(PIECES)] for i in range(m)]
    listeners: list[trio.SocketListener] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_fake_server, pieces, m - 2, listeners)
        summary = await trio.to_thread.run_sync(loadgen.run, _spec(port, m, 1))
        nursery.cancel_scope.cancel()
    assert summary["lost_tokens"] == 2 * summary["requests_completed"]


async def _silent_server(
    hang_up: bool, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Reads each request; then hangs up after a partial head, or never answers."""

    async def handle(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        if hang_up:
            await stream.send_all(b"HTTP/1.1 200 \r\ncontent-type: text/event-stream\r\n")
            await stream.aclose()
            return
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        got = await nursery.start(trio.serve_tcp, handle, 0)
        task_status.started(got[0].socket.getsockname()[1])


async def test_loadgen_counts_a_hang_up_as_failed_and_connects_again() -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_silent_server, True)
        spec = _spec(port, 4, 1)
        spec.duration_s, spec.max_requests = 5.0, 3
        summary = await trio.to_thread.run_sync(loadgen.run, spec)
        nursery.cancel_scope.cancel()
    # Each of the 3 requests went out on a new connection and failed; none hung the loop.
    assert summary["requests_started"] == summary["requests_failed"] == 3
    assert summary["requests_completed"] == 0
    assert "connection closed mid-response" in summary["errors"][0]


async def test_loadgen_fails_what_is_open_at_the_hard_time_limit() -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_silent_server, False)
        spec = _spec(port, 4, 3)
        spec.duration_s, spec.time_limit_s = 0.1, 0.5
        start = trio.current_time()
        summary = await trio.to_thread.run_sync(loadgen.run, spec)
        elapsed = trio.current_time() - start
        nursery.cancel_scope.cancel()
    assert summary["requests_started"] == summary["requests_failed"] == 3
    assert "hard time limit" in summary["errors"][0]
    assert elapsed < 5.0


# --- floor accounting ------------------------------------------------------------------


def test_floor_run_checks_ids_against_the_echo() -> None:
    spec = FloorSpec(
        input_addr="",
        output_addr="",
        prompt_ids=[7, 8],
        expected_ids=[7, 8, 7],
        max_tokens=3,
        concurrency=1,
        duration_s=1.0,
        max_requests=1,
        time_limit_s=5,
    )
    run = FloorRun(spec)
    good, bad = loadgen_stream(0.0), loadgen_stream(0.0)
    for i, ids in enumerate([[7], [8, 7]]):
        run.on_tokens(good, ids, 0.02 * (i + 1), 1.0)
    run.on_finish(good)
    run.on_tokens(bad, [7, 7, 7, 7], 0.02, 1.0)
    run.on_finish(bad)
    assert (run.lost, run.duplicated, run.bad_streams) == (0, 1, 1)
    out = run.summary(wall=0.1, cpu_s=0.01)
    assert out["ttft_p50_ms"] == pytest.approx(20.0)
    assert out["output_tokens"] == 7
    assert out["chunks"] == 3  # per-request deliveries, not zmq messages


def test_the_sse_floor_event_is_one_chunk_the_size_of_smgds_event() -> None:
    size, _, rest = EVENT.partition(b"\r\n")
    body, end = rest[: int(size, 16)], rest[int(size, 16) :]
    assert end == b"\r\n"
    assert body.startswith(b"data: ") and body.endswith(b"\n\n")
    # smgd's completion chunk for a one-token text is 194-199 bytes with its "data: " line.
    assert 190 <= len(body) <= 200


def test_sse_clients_hand_every_byte_to_the_sink() -> None:
    clients = SseClients(3)
    try:
        fds = list(clients.free)
        assert len(set(fds)) == 3
        for _ in range(50):
            for fd in fds:
                clients.write(fd)
    finally:
        read = clients.close()
    assert clients.written == 150 * len(EVENT)
    assert read == clients.written
    assert clients.sink.returncode == 0


def loadgen_stream(start: float) -> Any:
    from smgd.bench.floor import _Stream

    return _Stream(start=start)


# --- workload and report --------------------------------------------------------------------


def test_workload_offered_rate_saturates_at_the_batch() -> None:
    w = Workload(step_ms=20.0, max_batch=256, max_tokens=128, duration_s=10.0)
    assert w.offered_tokens_per_s(16) == pytest.approx(800.0)
    assert w.offered_tokens_per_s(1024) == pytest.approx(12800.0)
    assert w.request_s(1024) == pytest.approx(4 * 2.56)
    assert w.max_requests(16) * w.request_s(16) >= 16 * w.duration_s
    assert w.time_limit_s(1024) > w.duration_s + w.request_s(1024)


def test_build_prompt_has_exact_length_and_a_clean_echo() -> None:
    p = build_prompt(TINY_MODEL_DIR, 64, 100)
    assert len(p.ids) == 64
    assert p.expected_ids[64:] == p.ids[:36]
    assert len(p.prefix_lens) == 100
    assert p.prefix_lens[-1] == len(p.expected_text)
    assert p.expected_text.startswith("The quick brown fox")


def _point(**kw: Any) -> dict[str, Any]:
    base = {
        "concurrency": 16,
        "tokens_per_s": 760.0,
        "output_tokens": 10000,
        "server_cpu_s": 2.5,
        "mock_cpu_s": 0.5,
        "elapsed_s": 10.0,
        "ttft_p50_ms": 30.0,
        "ttft_p99_ms": 60.0,
        "itl_p50_ms": 21.0,
        "itl_p99_ms": 40.0,
        "peak_rss_kib": 60000,
        "idle_rss_kib": 56000,
        "lost_tokens": 0,
        "duplicated_tokens": 0,
        "requests_failed": 0,
        "tokens_per_chunk": 1.0,
        "chunks": 5000,
    }
    return {**base, **kw}


def test_derive_computes_the_figures() -> None:
    w = Workload(step_ms=20.0, max_batch=256)
    d = report.derive(_point(), w)
    assert d["cpu_us_per_token"] == pytest.approx(250.0)
    assert d["cpu_us_per_chunk"] == pytest.approx(500.0)
    # One /proc clock tick spread over the point's 10,000 tokens.
    assert d["cpu_grain_us_per_token"] == pytest.approx(
        1e6 / procstat.CLOCK_TICKS / 10000, abs=0.01
    )
    assert d["offered_tokens_per_s"] == pytest.approx(800.0)
    assert d["delivered_fraction"] == pytest.approx(0.95)
    assert d["ttft_p50_over_step_ms"] == pytest.approx(10.0)
    assert d["itl_p99_over_step_ms"] == pytest.approx(20.0)
    assert d["rss_per_stream_kib"] == pytest.approx(250.0)
    assert d["mock_cores"] == pytest.approx(0.05)
    assert not d["mock_bottleneck"]
    assert report.derive(_point(mock_cpu_s=8.0), w)["mock_bottleneck"]


def test_ratios_and_table_compare_at_equal_concurrency() -> None:
    w = Workload()
    targets = {
        "smgd": [report.derive(_point(), w)],
        "floor": [
            report.derive(_point(server_cpu_s=0.25, ttft_p50_ms=20.0), w),
            report.derive(_point(concurrency=64), w),
        ],
    }
    rows = report.ratios(targets)
    assert rows == [
        {
            "concurrency": 16,
            "vs": "floor",
            "cpu_per_token": 10.0,
            "tokens_per_s": 1.0,
            "ttft_p50_delta_ms": 10.0,
        }
    ]
    text = report.table(targets)
    assert text.count("\n") == 1 + 3
    assert "250.0" in text
    assert "16 | floor" in report.ratio_table(rows)


def test_rounds_are_summarised_as_median_and_range_per_point_and_ratio() -> None:
    w = Workload()
    rounds = []
    for smgd_cpu, vllm_cpu, lost in ((2.0, 5.0, 0), (3.0, 5.0, 2), (2.5, 4.0, 0)):
        targets = {
            "smgd": [report.derive(_point(server_cpu_s=smgd_cpu, lost_tokens=lost), w)],
            "vllm": [report.derive(_point(server_cpu_s=vllm_cpu, ttft_p50_ms=50.0), w)],
        }
        rounds.append({"targets": targets, "ratios": report.ratios(targets)})
    summary = report.round_summary(rounds)
    smgd = next(p for p in summary["points"] if p["target"] == "smgd")
    assert smgd["rounds"] == 3
    # 2.0, 3.0 and 2.5 s of CPU for 10,000 tokens: 200, 300 and 250 µs per token.
    assert smgd["cpu_us_per_token"] == {"median": 250.0, "min": 200.0, "max": 300.0, "n": 3}
    assert smgd["lost_tokens"] == 2  # summed: a loss in any round shows
    (ratio,) = summary["ratios"]
    assert (ratio["target"], ratio["concurrency"], ratio["vs"]) == ("smgd", 16, "vllm")
    # Per round 0.4, 0.6 and 0.625: the median of the ratios, not a ratio of medians.
    assert ratio["cpu_per_token"] == {"median": 0.6, "min": 0.4, "max": 0.62, "n": 3}
    assert ratio["ttft_p50_delta_ms"]["median"] == -20.0
    text = report.summary_table(summary)
    assert "| smgd | 16 | 3 |" in text
    assert "0.60 (0.40-0.62)" in text
    # Two rounds: the median is the mean of the middle two.
    assert report.round_summary(rounds[:2])["ratios"][0]["cpu_per_token"]["median"] == 0.5


# --- the real thing ---------------------------------------------------------------------


@pytest.mark.slow
def test_quick_bench_run_reports_every_figure_and_no_lost_tokens(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "smgd",
            "bench",
            "--quick",
            "--targets",
            "smgd,floor,floor-sse",
            "--concurrency",
            "1,16",
            # 1.5 s points, not --quick's 3 s: the figures are checked for being there and
            # consistent, not for their values, and the test runs on three Pythons in CI.
            "--duration",
            "1.5",
            "--no-plot",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert set(doc["targets"]) == {"smgd", "floor", "floor-sse"}
    assert "vllm" not in doc["targets"]
    for p in doc["targets"]["floor-sse"]:
        # One event written per delivery, and the client read every byte of them.
        assert p["sse_bytes_read"] == p["sse_bytes_written"] == p["chunks"] * len(EVENT)
    for name, points in doc["targets"].items():
        assert [p["concurrency"] for p in points] == [1, 16]
        for p in points:
            for key in (
                "tokens_per_s",
                "offered_tokens_per_s",
                "ttft_p50_ms",
                "ttft_p99_ms",
                "ttft_p50_over_step_ms",
                "itl_p50_ms",
                "itl_p99_ms",
                "itl_p50_over_step_ms",
                "cpu_us_per_token",
                "mock_cores",
            ):
                assert isinstance(p[key], float), (name, key, p[key])
            assert p["lost_tokens"] == 0
            assert p["duplicated_tokens"] == 0
            assert p["bad_streams"] == 0
            assert p["requests_failed"] == 0
            assert p["output_tokens"] == 32 * p["requests_completed"] > 0
            # A light point can spend under one /proc clock tick (the floor at C=1 does):
            # then it reads 0, and the grain says how coarse the figure is.
            assert p["cpu_us_per_token"] >= 0
            assert 0 < p["cpu_grain_us_per_token"] <= 1e6 / 100 / p["output_tokens"] + 0.01
            if name == "smgd" and p["concurrency"] == 16:
                # 16 HTTP streams for 3 s cost far more than a tick.
                assert p["cpu_us_per_token"] > 0
            if name == "smgd":
                assert p["peak_rss_mib"] > 10
                assert "rss_per_stream_kib" in p
    assert {r["vs"] for r in doc["ratios"]} == {"floor", "floor-sse"}
    # stdout reports the same figures as bench.json: the points table, then the ratio table.
    assert report.table(doc["targets"]) in done.stdout
    assert report.ratio_table(doc["ratios"]) in done.stdout
    points, ratios = _markdown_tables(done.stdout)
    col = {name: i for i, name in enumerate(points[0])}
    by_point = {(row[0], int(row[1])): row for row in points[1:]}
    assert set(by_point) == {(t, c) for t in ("smgd", "floor", "floor-sse") for c in (1, 16)}
    for name, pts in doc["targets"].items():
        for p in pts:
            row = by_point[name, p["concurrency"]]
            assert row[col["tok/s"]] == f"{p['tokens_per_s']:.0f}"
            assert row[col["TTFT p50"]] == f"{p['ttft_p50_ms']:.1f}"
            assert row[col["CPU µs/tok"]] == f"{p['cpu_us_per_token']:.1f}"
            assert [row[col[k]] for k in ("lost", "dup", "failed")] == ["0", "0", "0"]
    assert [(row[0], row[1], row[2]) for row in ratios[1:]] == [
        ("smgd", "1", "floor"),
        ("smgd", "16", "floor"),
        ("smgd", "1", "floor-sse"),
        ("smgd", "16", "floor-sse"),
    ]
    for row, r in zip(ratios[1:], doc["ratios"], strict=True):
        assert row[3] == f"{r['cpu_per_token']:.2f}"


def _markdown_tables(text: str) -> list[list[list[str]]]:
    """The ``| a | b |`` tables in ``text``, each a list of rows of stripped cells (separator
    rows left out); a line that is not a table row ends a table."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if not line.startswith("|"):
            if current:
                tables.append(current)
            current = []
        elif line.strip("|-") != "":
            current.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return tables


async def test_a_failing_target_is_recorded_and_does_not_stop_the_run() -> None:
    from smgd.bench.main import _guarded

    async def fails_in_a_nursery() -> list[dict[str, Any]]:
        async def boom() -> None:
            raise RuntimeError("engine exited during start-up")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(boom)
        return []

    async def works() -> list[dict[str, Any]]:
        return [{"concurrency": 1}]

    failed: dict[str, str] = {}
    assert await _guarded(fails_in_a_nursery(), "vllm", failed) is None
    assert failed == {"vllm": "RuntimeError: engine exited during start-up"}
    assert await _guarded(works(), "smgd", failed) == [{"concurrency": 1}]


def test_workers_target_config_gives_each_worker_a_full_batch_engine(tmp_path: Path) -> None:
    from smgd.bench.targets import smgd_config
    from smgd.config import load_config

    w = Workload(max_batch=256, step_ms=20.0)
    path = tmp_path / "smgd.toml"
    path.write_text(smgd_config(w, port=0, run_dir=str(tmp_path), workers=2))
    config = load_config(path, environ={})
    assert config.server.workers == 2
    assert [e.mock.max_batch for e in config.engines] == [256, 256]
    assert {m for e in config.engines for m in e.models} == {"tiny-mock"}


def test_offered_load_counts_every_workers_engine() -> None:
    w = Workload(max_batch=256, step_ms=20.0)
    one = report.derive(_point(concurrency=1024), w)
    two = report.derive({**_point(concurrency=1024), "engines": 2}, w)
    assert one["offered_tokens_per_s"] == 12_800.0
    assert two["offered_tokens_per_s"] == 25_600.0


@pytest.mark.parametrize(
    ("target", "target_cpu_s", "base", "base_cpu_s", "ratio"),
    [
        ("smgd-w2", 0.6, "smgd", 0.5, 1.2),  # several workers vs one process
        ("smgd", 0.4, "smgd-flat", 0.5, 0.8),  # coalescing vs off; smgd-flat is only a baseline
    ],
)
def test_an_smgd_target_is_compared_with_its_smgd_baseline(
    target: str, target_cpu_s: float, base: str, base_cpu_s: float, ratio: float
) -> None:
    w = Workload()
    targets = {
        base: [report.derive(_point(server_cpu_s=base_cpu_s), w)],
        target: [report.derive(_point(server_cpu_s=target_cpu_s), w)],
    }
    rows = report.ratios(targets)
    assert [(r.get("target", "smgd"), r["vs"]) for r in rows] == [(target, base)]
    assert rows[0]["cpu_per_token"] == ratio
    assert f"| {target} | 16 | {base} |" in report.ratio_table(rows)


def test_the_flat_target_runs_smgd_with_coalescing_off(tmp_path: Path) -> None:
    from smgd.bench.main import _targets
    from smgd.bench.targets import smgd_config
    from smgd.config import load_config

    assert _targets("smgd,smgd-flat") == ["smgd", "smgd-flat"]
    w = Workload()
    for coalesce, expected in ((True, 150.0), (False, 0.0)):
        path = tmp_path / f"smgd-{coalesce}.toml"
        path.write_text(smgd_config(w, port=0, run_dir=str(tmp_path), coalesce=coalesce))
        assert load_config(path, environ={}).server.coalesce_max_ms == expected


def test_rounds_must_be_a_positive_integer() -> None:
    import argparse

    from smgd.bench.main import add_bench_args

    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    assert parser.parse_args([]).rounds == 1
    assert parser.parse_args(["--rounds", "3"]).rounds == 3
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--rounds", bad])


# --- the tools workload (smgd-tools) -----------------------------------------------------


def test_tool_prompt_is_about_m_tokens_and_parses_to_its_reasoning_and_call() -> None:
    from smgd.bench.workload import build_tool_prompt

    p = build_tool_prompt(TINY_MODEL_DIR, 200)
    assert 200 <= p.reply_tokens <= 215  # grown a word at a time until M is reached
    assert p.reply.startswith("<think>\n") and "</think>\n\n<tool_call>\n" in p.reply
    ((name, args),) = p.calls
    assert name == "search_flights"
    assert json.loads(args)["destination"] == "Tokyo"
    assert p.reasoning.startswith("\nThe user wants") and p.reasoning.endswith("\n")
    # The flattened stream a client must see; one prefix length per reply token and the EOS.
    assert p.expected_text == p.reasoning + name + args
    assert len(p.prefix_lens) == p.reply_tokens
    assert p.prefix_lens[-1] == len(p.expected_text)
    assert p.prefix_lens == sorted(p.prefix_lens)
    assert p.prefix_lens[0] == 0  # `<think>` itself is markup: no text
    # The markup alone is over 100 tokens of this tokenizer: a small M gets the smallest reply.
    assert build_tool_prompt(TINY_MODEL_DIR, 1).reply_tokens < p.reply_tokens
    assert p.finish_reason == "tool_calls"


def test_the_no_parser_control_expects_the_whole_reply_as_content() -> None:
    from smgd.bench.workload import build_tool_prompt

    parsed = build_tool_prompt(TINY_MODEL_DIR, 128)
    raw = build_tool_prompt(TINY_MODEL_DIR, 128, parsers=False)
    assert (raw.reply, raw.reply_tokens) == (parsed.reply, parsed.reply_tokens)
    assert raw.expected_text == raw.reply  # markup and all
    assert raw.finish_reason == "stop"
    # Every reply token is text here; only the EOS adds nothing.
    text_lens = raw.prefix_lens[:-1]
    assert text_lens == sorted(set(text_lens))
    assert text_lens[0] > 0
    assert raw.prefix_lens[-1] == raw.prefix_lens[-2] == len(raw.reply)


TOOL_PIECES = ["\nhi", " there", "\n", "", "f", '{"a":', " 1}", ""]  # "" = markup, EOS


def _tool_spec(**kw: Any) -> Spec:
    return Spec(
        port=1,
        model="x",
        prompt_ids=[],
        max_tokens=len(TOOL_PIECES),
        concurrency=1,
        duration_s=1.0,
        max_requests=1,
        time_limit_s=5.0,
        expected_text="".join(TOOL_PIECES),
        prefix_lens=prefix_lengths(TOOL_PIECES),
        mode="tools",
        messages=[{"role": "user", "content": "hi"}],
        tools=[{"type": "function", "function": {"name": "f"}}],
        expected_tokens=len(TOOL_PIECES),
        **kw,
    )


def _chat_events(
    reasoning: list[str], *, finish: str = "tool_calls", call_id: str | None = "call_1"
) -> list[bytes]:
    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        return b"data: %s\n\n" % json.dumps({"choices": [choice]}).encode()

    first = {"index": 0, "id": call_id, "type": "function", "function": {"name": "f"}}
    if call_id is None:
        del first["id"]
    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"reasoning_content": r}) for r in reasoning]
    events.append(chunk({"tool_calls": [{**first, "function": {"name": "f", "arguments": ""}}]}))
    for piece in ('{"a":', " 1}"):
        events.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}))
    events.append(chunk({}, finish))
    usage = {"choices": [], "usage": {"completion_tokens": len(TOOL_PIECES)}}
    events += [b"data: %s\n\n" % json.dumps(usage).encode(), b"data: [DONE]\n\n"]
    return events


@pytest.mark.parametrize(
    ("reasoning", "extra", "lost", "bad"),
    [
        (["\nhi", " there", "\n"], {}, 0, 0),
        (["\nhi", "\n"], {}, 1, 1),  # a reasoning piece lost on the way
        (["\nhi", " there", " there", "\n"], {}, 0, 1),  # one sent twice
        (["\nhi", " there", "\n"], {"finish": "stop"}, 0, 1),  # not finish_reason tool_calls
        (["\nhi", " there", "\n"], {"call_id": None}, 0, 1),  # a call without its id
    ],
)
def test_tool_stream_checks_reasoning_calls_and_finish(
    reasoning: list[str], extra: dict[str, Any], lost: int, bad: int
) -> None:
    spec = _tool_spec()
    res = loadgen.Results()
    stream = loadgen._ToolStream(spec, res, 0.0, 10.0)
    raw = _chunked_response(_chat_events(reasoning, **extra))
    assert stream.feed(raw, 0.5)
    stream.finish()
    assert (res.completed, res.lost, res.bad_streams) == (1, lost, bad)
    if len(reasoning) == 4:
        assert res.duplicated >= 1
    assert res.usage_tokens == len(TOOL_PIECES)
    if not bad:  # every token in the window, the markup and EOS ones (no text) included
        assert res.window_tokens == res.text_tokens == len(TOOL_PIECES)
    # The chunks that carried text: reasoning pieces, the call's name, its two argument pieces.
    assert res.chunks == len(reasoning) + 3


def test_tools_request_is_a_streaming_chat_with_tools() -> None:
    spec = _tool_spec()
    spec.path = "/v1/chat/completions"
    head, _, payload = loadgen.build_request(spec).partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/chat/completions ")
    body = json.loads(payload)
    assert body["tools"] == spec.tools
    assert body["messages"] == spec.messages
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in body  # the reply ends with the model's EOS: finish tool_calls
    assert "prompt" not in body


def test_plain_loadgen_spec_is_unchanged_by_the_tools_workload() -> None:
    from smgd.bench.runner import loadgen_spec

    w = Workload(max_tokens=16)
    spec = loadgen_spec(
        port=1, model="m", prompt=build_prompt(TINY_MODEL_DIR, 8, 16), workload=w, concurrency=2
    )
    assert set(spec) == {
        "port", "model", "prompt_ids", "max_tokens", "concurrency", "duration_s",
        "max_requests", "time_limit_s", "expected_text", "prefix_lens", "extra",
        "new_connections",
    }  # fmt: skip
    decoded = loadgen.Spec(**spec)
    assert (decoded.mode, decoded.path) == ("plain", "/v1/completions")
    assert decoded.new_connections is False
    assert b'"ignore_eos":true' in loadgen.build_request(decoded)


def test_tool_stream_of_the_control_expects_content_and_stop() -> None:
    pieces = ["<think>", "hi", "</think>", ""]
    spec = _tool_spec(expected_finish="stop")
    spec.expected_text, spec.prefix_lens = "".join(pieces), prefix_lengths(pieces)
    spec.expected_tokens = len(pieces)

    def run(finish: str) -> loadgen.Results:
        res = loadgen.Results()
        stream = loadgen._ToolStream(spec, res, 0.0, 10.0)
        events = [
            b'data: {"choices":[{"index":0,"delta":{"content":%s}}]}\n\n' % json.dumps(p).encode()
            for p in pieces[:3]
        ]
        events.append(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"%s"}]}\n\n'
                      % finish.encode())  # fmt: skip
        events.append(b'data: {"choices":[],"usage":{"completion_tokens":4}}\n\n')
        events.append(b"data: [DONE]\n\n")
        assert stream.feed(_chunked_response(events), 0.1)
        stream.finish()
        return res

    assert (run("stop").bad_streams, run("stop").text_tokens) == (0, 4)
    assert run("tool_calls").bad_streams == 1


def test_tools_target_config_sets_the_parsers_and_the_script(tmp_path: Path) -> None:
    from smgd.bench.targets import smgd_config
    from smgd.bench.workload import build_tool_prompt
    from smgd.config import load_config

    w = Workload()
    (tmp_path / "replies.toml").write_text(build_tool_prompt(TINY_MODEL_DIR, 64).script())
    path = tmp_path / "smgd.toml"
    path.write_text(smgd_config(w, port=0, run_dir=str(tmp_path), script="replies.toml"))
    (engine,) = load_config(path, environ={}).engines
    assert (engine.tool_parser, engine.reasoning_parser) == ("hermes", "qwen3")
    assert engine.mock.script is not None
    path.write_text(
        smgd_config(w, port=0, run_dir=str(tmp_path), script="replies.toml", parsers=False)
    )
    (engine,) = load_config(path, environ={}).engines
    assert (engine.tool_parser, engine.reasoning_parser) == (None, None)
    assert engine.mock.script is not None
    plain = smgd_config(w, port=0, run_dir=str(tmp_path))
    assert "parser" not in plain
    assert "script" not in plain


def test_the_tools_target_is_compared_with_plain_smgd() -> None:
    from smgd.bench.main import _targets

    assert _targets("smgd,smgd-tools") == ["smgd", "smgd-tools"]
    w = Workload()
    targets = {
        "smgd": [report.derive(_point(server_cpu_s=2.0), w)],
        "smgd-tools": [report.derive(_point(server_cpu_s=3.0), w)],
    }
    rows = report.ratios(targets)
    assert [(r.get("target", "smgd"), r["vs"], r["cpu_per_token"]) for r in rows] == [
        ("smgd-tools", "smgd", 1.5)
    ]
    # With the control in the run, the tools target is compared with it too, and the control
    # with plain smgd.
    targets["smgd-tools-noparse"] = [report.derive(_point(server_cpu_s=2.5), w)]
    rows = report.ratios(targets)
    assert {(r.get("target", "smgd"), r["vs"], r["cpu_per_token"]) for r in rows} == {
        ("smgd-tools", "smgd", 1.5),
        ("smgd-tools", "smgd-tools-noparse", 1.2),
        ("smgd-tools-noparse", "smgd", 1.25),
    }
    assert _targets("smgd-tools-noparse") == ["smgd-tools-noparse"]


@pytest.mark.slow
def test_quick_tools_bench_run_reports_its_figures_and_no_lost_tokens(tmp_path: Path) -> None:
    argv = ["--targets", "smgd-tools", "--concurrency", "4", "--duration", "1.5",
            "--max-tokens", "32", "--no-plot", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "smgd", "bench", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    doc = json.loads((tmp_path / "bench.json").read_text())
    ((point,),) = doc["targets"].values()
    assert set(doc["targets"]) == {"smgd-tools"}
    for key in ("lost_tokens", "duplicated_tokens", "bad_streams", "requests_failed"):
        assert point[key] == 0, (key, point["errors"])
    assert point["requests_completed"] > 0
    # Every stream reported the whole reply (with its EOS) as its completion tokens.
    assert point["output_tokens"] == point["reply_tokens"] * point["requests_completed"]
    assert point["cpu_us_per_token"] > 0
    assert report.table(doc["targets"]) in done.stdout
    (points,) = _markdown_tables(done.stdout)[:1]
    col = {name: i for i, name in enumerate(points[0])}
    (row,) = points[1:]
    assert row[0] == "smgd-tools"
    assert row[col["CPU µs/tok"]] == f"{point['cpu_us_per_token']:.1f}"
    assert row[col["tok/s"]] == f"{point['tokens_per_s']:.0f}"
    assert [row[col[k]] for k in ("lost", "dup", "failed")] == ["0", "0", "0"]

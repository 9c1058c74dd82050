"""smgd bench's real-engine targets (``sglang-real``, ``vllm-real``) without engines: which
processes count as front end and engine, PSS/RSS from ``/proc``, the two sides' arguments,
the loadgen's ``count`` mode and the ratios. The targets themselves are run by ``smgd bench
--targets sglang-real,vllm-real`` (minutes: two engines each), which is their check."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from smgd.bench import loadgen, procstat, real
from smgd.bench.main import _targets
from smgd.bench.procstat import Stat
from smgd.bench.workload import Workload
from smgd.config import load_config
from smgd.launchers import cpu_shims_dir


def _tree(rows: list[tuple[int, int, str]]) -> tuple[list[Stat], dict[int, str]]:
    stats = [Stat(pid=pid, ppid=ppid, utime=0, stime=0) for pid, ppid, _ in rows]
    return stats, {pid: line for pid, _, line in rows}


# --- which processes count ------------------------------------------------------------------


def test_smgd_side_the_scheduler_and_its_children_are_the_engine() -> None:
    stats, lines = _tree(
        [
            (1, 0, "init"),
            (10, 1, "/v/bin/python -m smgd serve --config /tmp/x/smgd.toml"),
            (20, 10, "sglang::scheduler"),
            (21, 20, "/e/bin/python -B -c from multiprocessing.resource_tracker import main"),
            (30, 1, "sglang::scheduler"),  # another server's engine: not in this tree
        ]
    )
    roles = real.classify(10, stats, lines, real.SGLANG.engine_marks)
    assert roles == {"smgd": [10], "engine": [20, 21]}
    assert real.front_end(roles) == [10]


def test_smgd_side_a_launcher_resident_beside_the_scheduler_is_front_end() -> None:
    # The launcher as it was before issue 21: it spawned the scheduler and waited on it.
    stats, lines = _tree(
        [
            (10, 1, "python -m smgd serve --config c.toml"),
            (11, 10, "/e/bin/python /x/smgd/launchers/sglang_scheduler.py --smgd-input ipc://a"),
            (12, 11, "sglang::scheduler"),
        ]
    )
    roles = real.classify(10, stats, lines, real.SGLANG.engine_marks)
    assert roles == {"smgd": [10], "launcher": [11], "engine": [12]}
    assert real.front_end(roles) == [10, 11]


def test_sglang_own_server_front_end_is_the_http_process_and_the_detokenizer() -> None:
    stats, lines = _tree(
        [
            (50, 1, "/e/bin/python -m sglang.launch_server --model-path m --port 1"),
            (51, 50, "/e/bin/python -B -c from multiprocessing.resource_tracker import main"),
            (52, 50, "sglang::scheduler"),
            (53, 50, "sglang::detokenizer"),
        ]
    )
    roles = real.classify(50, stats, lines, real.SGLANG.engine_marks)
    assert roles == {"server": [50], "other": [51], "engine": [52], "detokenizer": [53]}
    assert real.front_end(roles) == [50, 51, 53]


def test_vllm_sides_the_engine_core_and_its_worker_are_the_engine() -> None:
    own, own_lines = _tree(
        [
            (70, 1, "/v/bin/python -c import importlib.metadata ... serve m --port 2"),
            (71, 70, "VLLM::EngineCore"),
            (72, 71, "VLLM::Worker"),
        ]
    )
    assert real.classify(70, own, own_lines, real.VLLM.engine_marks) == {
        "server": [70],
        "engine": [71, 72],
    }
    mine, mine_lines = _tree(
        [
            (80, 1, "python -m smgd serve --config c.toml"),
            (81, 80, "VLLM::EngineCore"),  # vllm_engine.py after vLLM set its title
            (82, 81, "VLLM::Worker"),
        ]
    )
    assert real.classify(80, mine, mine_lines, real.VLLM.engine_marks) == {
        "smgd": [80],
        "engine": [81, 82],
    }


def test_roles_of_a_live_tree_finds_this_process() -> None:
    roles = real.roles_of(os.getpid(), ("no-such-mark",))
    assert os.getpid() in real.front_end(roles)
    assert "engine" not in roles


ROLLUP = """\
55d5c0a4d000-7ffd4b9f5000 ---p 00000000 00:00 0                          [rollup]
Rss:              668620 kB
Pss:              523300 kB
Pss_Anon:         400000 kB
Shared_Clean:     120000 kB
"""


def test_parse_rollup_reads_pss_and_rss() -> None:
    assert real.parse_rollup_kib(ROLLUP, "Pss") == 523300
    assert real.parse_rollup_kib(ROLLUP, "Rss") == 668620
    assert real.parse_rollup_kib(ROLLUP, "Swap") == 0


def test_memory_of_this_process_from_proc() -> None:
    got = real.memory_kib([os.getpid()])
    assert 0 < got["pss_kib"] <= got["rss_kib"]
    assert got["rss_kib"] == pytest.approx(procstat.rss_kib([os.getpid()]), rel=0.2)
    assert real.memory_kib([2**22 + 7]) == {"pss_kib": 0, "rss_kib": 0}  # no such pid


def test_footprint_sums_each_role() -> None:
    fp = real.footprint({"smgd": [os.getpid()], "engine": []})
    assert fp["smgd"]["pids"] == [os.getpid()]
    assert fp["smgd"]["pss_kib"] > 0
    assert fp["engine"] == {"pids": [], "pss_kib": 0, "rss_kib": 0}


# --- the two sides' arguments ---------------------------------------------------------------


@pytest.mark.parametrize("engine", [real.SGLANG, real.VLLM])
def test_smgd_side_config_is_valid_and_launches_the_engine_with_the_flags(
    engine: real.RealEngine, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    text = real.smgd_config(
        engine, python="/e/bin/python", model=str(model), port=8123, run_dir=str(tmp_path)
    )
    path = tmp_path / "smgd.toml"
    path.write_text(text)
    config = load_config(path, environ={}, check_paths=False)
    [e] = config.engines
    assert e.launch is not None
    assert (e.wire.value, e.launch.kind) == (engine.wire, engine.wire)
    assert e.launch.python == "/e/bin/python"
    assert e.models == [real.SERVED_NAME]
    assert list(engine.flags) == [a for a in e.launch.args if a != "--cpu-shims"]
    assert ("--cpu-shims" in e.launch.args) is (engine is real.SGLANG)


def test_sglang_own_server_has_the_same_scheduler_flags_and_the_cpu_shims(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = real.own_argv(real.SGLANG, python="/e/bin/python", model="/m", port=9000)
    assert argv[:3] == ["/e/bin/python", "-m", "sglang.launch_server"]
    assert argv[-len(real.SGLANG_FLAGS) :] == list(real.SGLANG_FLAGS)
    assert argv[argv.index("--port") + 1] == "9000"
    assert argv[argv.index("--served-model-name") + 1] == real.SERVED_NAME
    monkeypatch.setenv("SGLANG_SERVER_EXTRAS", "/extras")
    monkeypatch.setenv("PYTHONPATH", "/mine")
    env = real.own_env(real.SGLANG)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(cpu_shims_dir()), "/extras", "/mine"]
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"


def test_vllm_own_server_is_vllm_serve_with_the_same_engine_flags() -> None:
    argv = real.own_argv(real.VLLM, python="/v/bin/python", model="/m", port=9001)
    assert argv[0] == "/v/bin/python"
    assert argv[3:5] == ["serve", "/m"]
    assert argv[-len(real.VLLM_FLAGS) :] == list(real.VLLM_FLAGS)
    assert argv[argv.index("--port") + 1] == "9001"
    # An engine flag too: smgd's launch keeps the engine's stats on, so vllm serve must as well.
    assert "--disable-log-stats" not in argv
    assert "--disable-log-stats" not in real.smgd_launch_args(real.VLLM)


def test_unavailable_names_what_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    assert "VLLM_PYTHON" in (real.unavailable(real.VLLM) or "")
    python = tmp_path / "python"
    python.write_text("")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setenv("SGLANG_PYTHON", str(python))
    monkeypatch.setenv("SGLANG_MODEL", str(model))
    monkeypatch.delenv("SGLANG_SERVER_EXTRAS", raising=False)
    assert "sglang-server-extras.sh" in (real.unavailable(real.SGLANG) or "")
    monkeypatch.setenv("SGLANG_SERVER_EXTRAS", str(tmp_path))
    assert real.unavailable(real.SGLANG) is None


def test_the_targets_are_accepted_on_the_command_line() -> None:
    assert _targets("sglang-real,vllm-real") == ["sglang-real", "vllm-real"]


# --- the loadgen's count mode ---------------------------------------------------------------


def _count_spec(max_tokens: int, *, new_connections: bool = False) -> loadgen.Spec:
    workload = Workload(max_tokens=max_tokens, new_connections=new_connections)
    spec = real.count_spec(port=1, ids=[5, 6], workload=workload, concurrency=2, duration_s=1.0)
    return loadgen.Spec(**spec)


def _raw(pieces: list[str], usage: int | None) -> bytes:
    events = [
        b'data: {"choices":[{"index":0,"text":%s}]}\n\n' % json.dumps(p).encode() for p in pieces
    ]
    if usage is not None:
        events.append(b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\n' % usage)
    events.append(b"data: [DONE]\n\n")
    head = b"HTTP/1.1 200 \r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = b"".join(f"{len(e):x}\r\n".encode() + e + b"\r\n" for e in events)
    return head + body + b"0\r\n\r\n"


def test_count_spec_asks_for_ignore_eos_and_usage_without_expected_text() -> None:
    spec = _count_spec(64)
    assert spec.mode == "count"
    assert spec.expected_text == "" and spec.prefix_lens == []
    body = json.loads(loadgen.build_request(spec).partition(b"\r\n\r\n")[2])
    assert body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["prompt"] == [5, 6]
    assert body["max_tokens"] == 64
    assert spec.new_connections is False


def test_count_spec_keeps_the_benchs_connection_per_request() -> None:
    assert _count_spec(64, new_connections=True).new_connections is True


@pytest.mark.parametrize(
    ("usage", "lost", "dup", "bad"), [(4, 0, 0, 0), (3, 1, 0, 0), (5, 0, 1, 0), (None, 4, 0, 1)]
)
def test_count_stream_checks_the_usage_alone(
    usage: int | None, lost: int, dup: int, bad: int
) -> None:
    res = loadgen.Results()
    stream = loadgen._CountStream(_count_spec(4), res, 0.0, 10.0)
    assert stream.feed(_raw(["a random", " text", "", " x"], usage), 0.5)
    stream.finish()
    assert (res.completed, res.lost, res.duplicated, res.bad_streams) == (1, lost, dup, bad)
    assert res.chunks == 3  # the empty piece is no chunk
    assert res.usage_tokens == (usage or 0)
    assert res.window_tokens == (usage or 0)  # all of it arrived inside the window
    assert res.ttft == [0.5]


def test_count_stream_splits_tokens_at_the_window_by_characters() -> None:
    res = loadgen.Results()
    stream = loadgen._CountStream(_count_spec(4), res, 0.0, 1.0)
    raw = _raw(["ab", "cd", "ef", "gh"], 4)
    data = raw.rindex(b"data:", 0, raw.index(b'"ef"'))  # the third event
    cut = raw.rindex(b"\r\n", 0, raw.rindex(b"\r\n", 0, data)) + 2  # its chunk's size line
    assert not stream.feed(raw[:cut], 0.5)
    assert stream.feed(raw[cut:], 1.5)
    stream.finish()
    assert res.window_tokens == 2  # 4 tokens x 4 of 8 characters inside the window
    assert res.usage_tokens == 4


# --- figures --------------------------------------------------------------------------------


def _point(c: int, cpu_s: float, tokens: int, tok_s: float, ttft: float, pss_kib: int) -> Any:
    return {
        "concurrency": c,
        "output_tokens": tokens,
        "tokens_per_s": tok_s,
        "chunks": tokens,
        "server_cpu_s": cpu_s,
        "engine_cpu_s": 1.0,
        "mock_cpu_s": 1.0,
        "elapsed_s": 10.0,
        "ttft_p50_ms": ttft,
        "ttft_p99_ms": ttft,
        "itl_p50_ms": 50.0,
        "itl_p99_ms": 90.0,
        "peak_rss_kib": pss_kib,
        "idle_rss_kib": pss_kib,
        "frontend_idle_pss_kib": pss_kib,
        "frontend_idle_rss_kib": pss_kib * 2,
        "roles_idle": {"smgd": {"pids": [1], "pss_kib": pss_kib, "rss_kib": pss_kib * 2}},
    }


def test_derive_drops_the_mock_step_figures_and_keeps_the_engine_cores() -> None:
    w = Workload()
    out = real.derive(_point(16, 0.5, 1000, 100.0, 300.0, 40 * 1024), w)
    assert out["cpu_us_per_token"] == 500.0
    assert out["engine_cores"] == 0.1
    assert out["frontend_idle_pss_mib"] == 40.0
    assert out["frontend_idle_rss_mib"] == 80.0
    for key in ("offered_tokens_per_s", "delivered_fraction", "ttft_p50_over_step_ms"):
        assert out[key] is None


def test_ratios_pair_smgd_with_the_engines_own_server() -> None:
    w = Workload()
    targets = {
        "sglang-real/smgd": [real.derive(_point(16, 0.2, 1000, 120.0, 250.0, 40 * 1024), w)],
        "sglang-real/sglang": [real.derive(_point(16, 0.8, 1000, 100.0, 300.0, 1000 * 1024), w)],
        "vllm-real/smgd": [real.derive(_point(16, 0.2, 1000, 100.0, 300.0, 40 * 1024), w)],
    }
    [row] = real.ratios(targets)  # vllm-real has no baseline in this run
    assert row == {
        "target": "sglang-real/smgd",
        "concurrency": 16,
        "vs": "sglang-real/sglang",
        "cpu_per_token": 0.25,
        "tokens_per_s": 1.2,
        "ttft_p50_delta_ms": -50.0,
        "frontend_pss": 0.04,
    }
    table = real.memory_table(targets)
    assert "| sglang-real/sglang | smgd | 1 | 1000.0 | 2000.0 |" in table

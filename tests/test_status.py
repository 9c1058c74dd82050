"""`smgd status` and `smgd reload`: pure rendering/rates, and against a real in-process daemon."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import trio

from smgd.config import AdminConfig, Config, ServerConfig, load_config
from smgd.status import (
    Sample,
    Target,
    _fold_metrics,
    render,
    run_reload,
    run_status,
    target_from_config,
    token_rates,
)

from .daemon_harness import config_text, engine_toml, running_daemon, stream_completion


def engine_row(name: str, tokens: int, **extra: Any) -> dict[str, Any]:
    row = {
        "name": name, "wire": "mock", "state": "ready", "in_flight": 0, "requests_total": 0,
        "tokens_total": tokens, "decode_errors": 0, "last_error": None, "load": None,
        "max_model_len": 4096, "queue_depth": 0, "rejected_total": 0,
    }  # fmt: skip
    row.update(extra)
    return row


def sample(t: float, *engines: dict[str, Any], **admin: Any) -> Sample:
    body: dict[str, Any] = {
        "draining": False,
        "uptime_s": 75.0,
        "reloads_total": 0,
        "reload_failures_total": 0,
    }
    body.update(admin)
    body["engines"] = list(engines)
    return Sample(t, body)


def test_token_rates_from_two_samples() -> None:
    before = sample(10.0, engine_row("a", 100), engine_row("b", 500))
    after = sample(12.0, engine_row("a", 300), engine_row("b", 40), engine_row("new", 7))
    rates = token_rates(before, after)
    assert rates["a"] == pytest.approx(100.0)
    assert rates["b"] == pytest.approx(20.0)  # counter went down: restarted, counts from 0
    assert rates["new"] is None  # no earlier reading
    assert token_rates(None, after) == {"a": None, "b": None, "new": None}


def test_render_table() -> None:
    now = sample(
        5.0,
        engine_row("alpha", 0, in_flight=3, queue_depth=2, load={"running": 3, "waiting": 1,
                   "kv_usage": 0.42}),
        engine_row("beta", 0, state="dead", last_error="no output for 30 s"),
        draining=True, reloads_total=2, reload_failures_total=1, uptime_s=3725.0,
    )  # fmt: skip
    now.requests = {"ok": 5.0, "error": 1.0}
    now.aborts = {"client_disconnect": 2.0}
    text = render(now, {"alpha": 12.345, "beta": None})
    lines = text.splitlines()
    assert lines[0] == "smgd up 1h02m  DRAINING  reloads 2 (failed 1)"
    header = next(line for line in lines if line.startswith("ENGINE"))
    alpha = next(line for line in lines if line.startswith("alpha")).split()
    beta = next(line for line in lines if line.startswith("beta")).split()
    assert header.split()[:8] == [
        "ENGINE", "WIRE", "STATE", "INFLIGHT", "QUEUED", "RUN/WAIT", "KV", "TOK/S",
    ]  # fmt: skip
    assert alpha[:8] == ["alpha", "mock", "ready", "3", "2", "3/1", "42%", "12.3"]
    assert beta[:8] == ["beta", "mock", "dead", "0", "0", "-", "-", "-"]
    assert "requests: error=1 ok=5" in lines
    assert "aborts: client_disconnect=2" in lines
    assert lines[-1] == "  beta: no output for 30 s"


def test_target_from_config(tmp_path: Path) -> None:
    config = Config(run_dir=str(tmp_path / "run"), server=ServerConfig(host="0.0.0.0", port=8080))
    target = target_from_config(config, environ={})
    assert target.uds == str(tmp_path / "run" / "admin.sock")
    assert target.public_url == "http://127.0.0.1:8080"
    assert target.token is None
    tcp = Config(
        server=ServerConfig(port=0),
        admin=AdminConfig(host="::1", port=9999, token_env="ADMIN_TOKEN"),
    )
    target = target_from_config(tcp, environ={"ADMIN_TOKEN": "s3cret"})
    assert target == Target("http://[::1]:9999", token="s3cret", public_url=None)


async def test_unreachable_daemon(tmp_path: Path) -> None:
    target = Target("http://smgd", uds=str(tmp_path / "admin.sock"))
    out, err = io.StringIO(), io.StringIO()
    assert await run_status(target, out=out, err=err, interval=0.01) == 1
    assert "is smgd running" in err.getvalue() and str(tmp_path) in err.getvalue()
    assert await run_reload(target, out=out, err=err) == 2
    assert out.getvalue() == ""


@pytest.mark.slow
async def test_status_and_reload_against_a_running_daemon(tmp_path: Path) -> None:
    path = tmp_path / "smgd.toml"
    engine = engine_toml("solo", "m-solo", step_ms=10)
    path.write_text(config_text(engine))
    async with running_daemon(path) as (daemon, client):
        gateway = daemon.gateway
        target = target_from_config(load_config(path, environ={}), public_url=str(client.base_url))
        assert daemon.admin_binds  # the admin listener the CLI talks to is up
        await stream_completion(client, "m-solo", "hello", 4)
        out, err = io.StringIO(), io.StringIO()
        async with trio.open_nursery() as nursery:
            # 2000 tokens at >= 10 ms a step keep the engine generating while status samples;
            # the stream is hung up on afterwards.
            nursery.start_soon(stream_completion, client, "m-solo", "hello", 2000)
            await trio.sleep(0.1)
            code = await run_status(target, out=out, err=err, interval=0.2)
            nursery.cancel_scope.cancel()
        assert code == 0, err.getvalue()
        text = out.getvalue()
        row = next(line for line in text.splitlines() if line.startswith("solo")).split()
        assert (row[0], row[2]) == ("solo", "ready")  # the mock engine speaks a real wire
        assert float(row[7]) > 0  # tokens/s between the two samples
        assert "requests: ok=1" in text  # the first stream; the second is still running

        # --watch: redraws N times
        out = io.StringIO()
        code = await run_status(target, out=out, err=err, watch=0.05, iterations=3)
        assert code == 0
        assert out.getvalue().count("ENGINE") == 3
        assert "ok=1" in out.getvalue()  # from /metrics: the finished stream

        # reload: nothing changed, then a bad file (rejected, the old config stays)
        out = io.StringIO()
        assert await run_reload(target, out=out, err=err) == 0
        assert out.getvalue().startswith("reload applied")
        run_dir = gateway.config.run_dir
        bad = config_text(engine.replace('wire = "mock"', 'wire = "tgi"')).split("\n", 1)[1]
        path.write_text(f'run_dir = "{run_dir}"\n' + bad)
        err = io.StringIO()
        assert await run_reload(target, out=out, err=err) == 1
        assert "rejected" in err.getvalue() and "$.engines[0].wire" in err.getvalue()
        assert gateway.reloads_total == 2 and gateway.reload_failures_total == 1
        metrics = (await client.get("/metrics")).text
        assert "smgd_reload_failures_total 1.0" in metrics
    err = io.StringIO()
    assert await run_reload(target, out=out, err=err) == 2  # the daemon is gone
    assert await run_status(target, out=out, err=err, interval=0.01) == 1


def test_metrics_of_several_workers_are_summed_per_status_and_reason() -> None:
    text = (
        "# HELP smgd_requests_total r\n# TYPE smgd_requests_total counter\n"
        'smgd_requests_total{engine="a",model="m",status="ok",worker="0"} 3.0\n'
        'smgd_requests_total{engine="b",model="m",status="ok",worker="1"} 4.0\n'
        "# HELP smgd_aborts_total a\n# TYPE smgd_aborts_total counter\n"
        'smgd_aborts_total{reason="client_disconnect",worker="0"} 1.0\n'
        'smgd_aborts_total{reason="client_disconnect",worker="1"} 2.0\n'
    )
    sample = Sample(t=0.0, admin={})
    _fold_metrics(sample, text)
    assert sample.requests == {"ok": 7.0}
    assert sample.aborts == {"client_disconnect": 3.0}

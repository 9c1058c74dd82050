"""Fault suite: `smgd reload` of a changed, added or removed engine under 64 streams.

What a client sees: no stream on an engine the reload does not replace loses a token; the
streams of a replaced or removed engine finish first (the drain); the changed engine serves
again, on a new process, without a restart of smgd; the daemon never exits.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
import trio

from .harness import StreamOutcome, daemon_toml, mock_engine_toml, serve, stream, until

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox"
KEEP_STREAMS, OTHER_STREAMS = 48, 16  # 64 concurrent streams
# 10 ms steps: the untouched engine's streams (150 tokens, ~1.5 s) outlast the reload, the
# replaced engine's (100 tokens) drain in about a second, well inside the 10 s drain timeout.
STEP_MS = 10.0
KEEP_TOKENS, OTHER_TOKENS = 150, 100
DRAIN_S = 10.0
# A reload that replaces an engine: its drain (~1 s) + stopping the old process + binding the
# new one. Generous for a loaded 2-core machine; a hang or a lost stream is far beyond it.
RELOAD_WITHIN_S = DRAIN_S


def config(*engines: str) -> str:
    return daemon_toml(*engines, drain_s=DRAIN_S)


KEEP = mock_engine_toml("keep", "m-keep", step_ms=STEP_MS)
OTHER = mock_engine_toml("other", "m-other", step_ms=STEP_MS)
CHANGES = {
    # step_ms is read by the engine process: the engine is drained and replaced.
    "changed": config(KEEP, mock_engine_toml("other", "m-other", step_ms=4.0)),
    # max_queue is smgd's own admission limit: applied in place, nothing interrupted.
    "changed_in_place": config(
        KEEP, mock_engine_toml("other", "m-other", step_ms=STEP_MS, extra="max_queue = 256\n")
    ),
    "added": config(KEEP, OTHER, mock_engine_toml("new", "m-new", step_ms=STEP_MS)),
    "removed": config(KEEP),
}


def complete(outcome: StreamOutcome, tokens: int) -> bool:
    return (
        outcome.status == 200
        and outcome.error is None
        and outcome.done
        and outcome.body_complete
        and outcome.finish_reason == "length"
        and outcome.usage is not None
        and outcome.usage["completion_tokens"] == tokens
    )


@pytest.mark.parametrize("change", list(CHANGES))
async def test_reload_under_64_streams_loses_no_token(tmp_path: Path, change: str) -> None:
    text = config(KEEP, OTHER)
    async with serve(tmp_path, text) as daemon, daemon.client() as client:
        # What a whole stream of the untouched engine says, before anything happens.
        reference = await stream(client, "m-keep", PROMPT, KEEP_TOKENS)
        assert complete(reference, KEEP_TOKENS)
        engines_before = set(daemon.engine_pids())
        keep: list[StreamOutcome] = [StreamOutcome(status=0) for _ in range(KEEP_STREAMS)]
        other: list[StreamOutcome] = [StreamOutcome(status=0) for _ in range(OTHER_STREAMS)]
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for outcome in keep:
                    nursery.start_soon(_run, client, "m-keep", KEEP_TOKENS, outcome)
                for outcome in other:
                    nursery.start_soon(_run, client, "m-other", OTHER_TOKENS, outcome)

                async def under_way() -> bool:
                    return all(len(o.chunks) >= 3 for o in keep + other)

                await until(under_way, 30)
                # The same run_dir: `smgd reload` finds the admin socket through it.
                run_line = text.split("\n", 1)[0]
                daemon.config_path.write_text(run_line + "\n" + CHANGES[change].split("\n", 1)[1])
                started = trio.current_time()
                code, output = await daemon.reload()
                took = trio.current_time() - started
        assert code == 0, output
        assert took < RELOAD_WITHIN_S
        # 0 tokens lost on the untouched engine: every stream whole, token for token.
        assert all(complete(o, KEEP_TOKENS) for o in keep)
        assert {o.text for o in keep} == {reference.text}
        # The changed or removed engine's streams finished before it was stopped.
        assert all(complete(o, OTHER_TOKENS) for o in other)
        assert daemon.proc.returncode is None and "Traceback" not in daemon.log()
        engines_after = set(daemon.engine_pids())
        if change == "changed":
            assert "replaced other" in output
            assert len(engines_after) == 2 and len(engines_after - engines_before) == 1
        elif change == "changed_in_place":
            assert "changed other" in output and "replaced" not in output
            assert engines_after == engines_before  # the same processes
        elif change == "added":
            assert "added new" in output and len(engines_after) == 3
        else:
            assert "removed other" in output and len(engines_after) == 1
        await daemon.wait_ready(within=30)
        if change == "removed":
            gone = await client.post(
                "/v1/completions", json={"model": "m-other", "prompt": "x", "max_tokens": 2}
            )
            assert gone.status_code == 404
        else:
            for model in ["m-keep", "m-other"] + (["m-new"] if change == "added" else []):
                assert complete(await stream(client, model, PROMPT, 5), 5)


async def test_a_replaced_engine_answers_503_not_404_while_it_drains(
    tmp_path: Path,
) -> None:
    text = config(KEEP, OTHER)
    async with serve(tmp_path, text) as daemon, daemon.client() as client:
        running = StreamOutcome(status=0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_run, client, "m-other", 300, running)

            async def under_way() -> bool:
                return len(running.chunks) >= 3

            await until(under_way, 30)
            run_line = text.split("\n", 1)[0]
            daemon.config_path.write_text(run_line + "\n" + CHANGES["changed"].split("\n", 1)[1])
            nursery.start_soon(daemon.reload)

            async def draining() -> bool:
                ready = (await client.get("/readiness")).json()
                return bool(ready["engines"]["other"]["state"] == "draining")

            await until(draining, 10)
            body = {"model": "m-other", "prompt": "x", "max_tokens": 2}
            refused = await client.post("/v1/completions", json=body)
        assert refused.status_code == 503 and refused.headers.get("retry-after")
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert complete(running, 300)  # the stream in flight finished on the old engine


# What an editor or a careless hand saves over smgd.toml, each refused whole by a SIGHUP.
BROKEN_FILES = {
    "not_utf8": b"# caf\xe9\n",  # a Latin-1 comment: once a crash of the daemon
    "not_toml": b"[server\n",
    "unknown_key": b"[server]\nprot = 1\n",
}


@pytest.mark.parametrize("broken", list(BROKEN_FILES))
async def test_a_sighup_of_a_broken_file_changes_nothing_and_cuts_no_stream(
    tmp_path: Path, broken: str
) -> None:
    text = config(KEEP)
    async with serve(tmp_path, text) as daemon, daemon.client() as client:
        engines_before = set(daemon.engine_pids())
        streams = [StreamOutcome(status=0) for _ in range(8)]
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for outcome in streams:
                    nursery.start_soon(_run, client, "m-keep", KEEP_TOKENS, outcome)

                async def under_way() -> bool:
                    return all(len(o.chunks) >= 3 for o in streams)

                await until(under_way, 30)
                daemon.config_path.write_bytes(text.encode() + BROKEN_FILES[broken])
                daemon.send_signal(signal.SIGHUP)

                async def refused() -> bool:
                    return "reload rejected, nothing changed" in daemon.log()

                await until(refused, 10)
        assert all(complete(o, KEEP_TOKENS) for o in streams)
        assert daemon.proc.returncode is None and "Traceback" not in daemon.log()
        assert set(daemon.engine_pids()) == engines_before
        metrics = (await client.get("/metrics")).text
        assert "\nsmgd_reload_failures_total 1.0\n" in metrics
        assert complete(await stream(client, "m-keep", PROMPT, 5), 5)


def _ignores_sighup(pid: int) -> bool:
    """The process's SIGHUP disposition is 'ignore' (/proc's SigIgn mask, bit 0 = signal 1)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & 1 << (signal.SIGHUP - 1))
    return False


async def test_a_sighup_while_smgd_still_starts_does_not_end_it(tmp_path: Path) -> None:
    # An init system or a deploy script may send its reload at any time, the first half
    # second included, when smgd still imports and has no handler of its own yet.

    async def sighup_at_once(proc: trio.Process) -> None:
        with trio.fail_after(30):
            while not _ignores_sighup(proc.pid):  # noqa: ASYNC110 - another process's state
                await trio.sleep(0.002)
        proc.send_signal(signal.SIGHUP)

    async with serve(tmp_path, config(KEEP), while_starting=sighup_at_once) as daemon:
        assert daemon.proc.returncode is None, daemon.log()
        async with daemon.client() as client:
            assert complete(await stream(client, "m-keep", PROMPT, 5), 5)


async def _run(client: httpx.AsyncClient, model: str, tokens: int, into: StreamOutcome) -> None:
    await stream(client, model, PROMPT, tokens, into=into)

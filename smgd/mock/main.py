"""``smgd mock-engine``: run a mock engine scheduler as its own process, on a given wire."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from smgd.gc_tuning import tune_gc
from smgd.launchers.lifeline import PARENT_ENV
from smgd.mock.engine import FAULTS, EngineExit, MockEngine, MockWire
from smgd.mock.scheduler import MockScheduler
from smgd.mock.script import Script

if TYPE_CHECKING:
    import argparse


# How often a mock smgd did not launch checks that its parent is alive: such an orphan
# lingers at most this long.
PARENT_CHECK_S = 1.0


def _ids(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def add_mock_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wire", choices=["sglang", "vllm", "tokenspeed"], default="sglang")
    parser.add_argument("--input", required=True, help="smgd's request endpoint (we connect)")
    parser.add_argument("--output", required=True, help="smgd's output endpoint (we connect)")
    parser.add_argument("--handshake", default=None, help="handshake endpoint (vllm/tokenspeed)")
    parser.add_argument("--step-ms", type=float, default=20.0, help="time per engine step")
    parser.add_argument("--max-batch", type=int, default=256, help="running requests per step")
    parser.add_argument("--context-len", type=int, default=4096)
    parser.add_argument("--eos-token-ids", type=_ids, default=[])
    parser.add_argument("--skip-ids", type=_ids, default=[], help="ids never echoed (specials)")
    parser.add_argument("--control", default=None, help="PULL endpoint for fault commands")
    parser.add_argument(
        "--fault",
        choices=[fault for fault in FAULTS if fault != "ok"],  # "ok" clears one: nothing to inject
        default=None,
        help="inject this fault after --fault-after-steps steps",
    )
    parser.add_argument("--fault-after-steps", type=int, default=0)
    parser.add_argument(
        "--priority-scheduling",
        action="store_true",
        help="admit waiting requests lowest priority first ([[engines]] scheduling)",
    )
    parser.add_argument(
        "--script",
        default=None,
        help="TOML file of scripted replies ([engines.mock] script); needs --model-dir",
    )
    parser.add_argument("--model-dir", default=None, help="the model whose tokenizer a script uses")
    parser.add_argument("--tokenizer-dir", default=None, help="its tokenizer, if elsewhere")
    parser.add_argument(
        "--remote",
        action="store_true",
        help="vllm: announce a remote engine core (for vLLM's own front end with "
        "--data-parallel-size-local 0)",
    )


def build_wire(args: argparse.Namespace) -> MockWire:
    if args.wire == "sglang":
        from smgd.mock.sglang import SglangMockWire

        return SglangMockWire(args.input, args.output)
    if args.wire in ("tokenspeed", "vllm") and not args.handshake:
        raise SystemExit(f"mock-engine: --wire {args.wire} needs --handshake (the engine dials in)")
    if args.wire == "tokenspeed":
        from smgd.mock.tokenspeed import TokenspeedMockWire

        # The engine learns --input/--output from smgd's INIT; the flags are kept for symmetry.
        return TokenspeedMockWire(
            args.handshake, context_len=args.context_len, max_batch=args.max_batch
        )
    from smgd.mock.vllm import VllmMockWire

    return VllmMockWire(
        args.handshake,
        context_len=args.context_len,
        max_batch=args.max_batch,
        local=not args.remote,
    )


def load_script(args: argparse.Namespace) -> Script | None:
    """The ``--script`` replies, tokenized with the model's tokenizer (None: no script)."""
    if args.script is None:
        return None
    if args.model_dir is None:
        raise SystemExit("mock-engine: --script needs --model-dir (its tokenizer writes the text)")
    # Only a scripted mock loads a tokenizer: the plain echo starts without one.
    from smgd.config import load_mock_script
    from smgd.errors import ConfigError
    from smgd.text.tokenizer import load_tokenizer

    try:
        script = load_mock_script(Path(args.script))
        tokenizer = load_tokenizer(args.model_dir, args.tokenizer_dir)
    except ConfigError as exc:
        raise SystemExit(f"mock-engine: {exc.one_line()}") from None
    return Script.build(
        script,
        encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
    )


def mock_engine_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tune_gc()  # its steps keep their cadence, as a GPU engine's do (smgd.gc_tuning)
    sched = MockScheduler(
        max_batch=args.max_batch,
        eos_ids=args.eos_token_ids,
        skip_ids=args.skip_ids,
        script=load_script(args),
        priority_scheduling=args.priority_scheduling,
    )
    engine = MockEngine(
        build_wire(args),
        sched,
        step_s=args.step_ms / 1000,
        control=args.control,
        exit_process_on_die=True,
    )

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            if not _tied_by_kernel():
                nursery.start_soon(_exit_with_parent, os.getppid())
            info = {
                "context_length": args.context_len,
                "max_running_requests": args.max_batch,
                # As the vLLM mock's handshake: room for a full batch of full contexts.
                "max_total_num_tokens": args.context_len * args.max_batch,
                "version": "smgd-mock",
            }
            print("SMGD_READY " + json.dumps(info), flush=True)
            if args.fault:
                # The scheduler is sans-IO (no events): poll it once per step.
                while sched.steps < args.fault_after_steps:  # noqa: ASYNC110
                    await trio.sleep(args.step_ms / 1000)
                engine.inject(args.fault)

    try:
        trio.run(main)
    except KeyboardInterrupt:
        return 0
    except BaseException as exc:
        code = _exit_code(exc, EngineExit)
        if code is None:
            raise
        print(f"mock-engine: exiting with {code}", file=sys.stderr)
        return code
    return 0


def _tied_by_kernel() -> bool:
    """Started by smgd, through launchers/lifeline.py: the kernel kills us when smgd dies.

    Then the mock does no watching of its own, like a real engine, so what keeps it from
    outliving smgd is exactly what keeps vLLM and SGLang from it (the fault suite's case).
    """
    return os.environ.get(PARENT_ENV) == str(os.getpid())


async def _exit_with_parent(parent: int) -> None:
    """Exit when the process that started us is gone: for a mock started any other way
    (a benchmark, a shell), which nothing else would stop."""
    while os.getppid() == parent:  # noqa: ASYNC110 - no event exists for "parent died"
        await trio.sleep(PARENT_CHECK_S)
    raise EngineExit(0)


def _exit_code(exc: BaseException, kind: type[Exception]) -> int | None:
    if isinstance(exc, kind):
        return int(exc.args[0])
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            code = _exit_code(inner, kind)
            if code is not None:
                return code
    return None

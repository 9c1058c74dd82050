"""Start ONE headless vLLM V1 engine core that connects to smgd's handshake socket.

Run by the vLLM venv's python, never imported by smgd (that venv has no smgd, and smgd's has
no vLLM), so this file uses the standard library and vLLM only:

    $VLLM_PYTHON smgd/launchers/vllm_engine.py --handshake-address ipc:///run/smgd/h.sock \\
        --model DIR --dtype float32 --max-model-len 512 --max-num-seqs 8 --enforce-eager \\
        [--kv-cache-memory-bytes N] [--engine-index 0] [--remote] [any vLLM engine flag]

It does what ``vllm serve --headless`` does, minus its limits: any ZMQ transport works for the
handshake (that command hard-codes tcp), and the engine core runs in this process (one
interpreter start fewer; the CPU platform still spawns one worker process). smgd binds the
handshake ROUTER before or after this starts (ZMQ connect retries); the engine waits up to
5 minutes for the INIT reply. SIGTERM shuts the engine down cleanly (exit 0); in-flight
requests get an ABORT output first. The engine's exit code is this process's exit code.

The KV cache is always capped: without ``--kv-cache-memory-bytes`` or
``VLLM_CPU_KVCACHE_SPACE`` vLLM sizes it from free RAM, which on a shared box starves
everything else. Logs go to stderr.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

T0 = time.monotonic()
# smgd started this process through lifeline.py: it dies with smgd. Its children (the CPU
# worker vLLM spawns, any process that one forks) must die with it; the kernel's death signal
# does not reach them, so they tie themselves when they import this file as __mp_main__ (as
# every multiprocessing child does). lifeline.py is next to this file, on sys.path as the
# script's directory; imported by name so smgd's type checker need not resolve it.
lifeline = importlib.import_module("lifeline")
if __name__ == "__mp_main__":
    lifeline.hold_parent()
lifeline.tie_children()
# 256 MiB holds 65k+ tokens of the tiny test model and a few thousand of a 1B model, and
# keeps the worker's resident set near 0.9 GB; pass --kv-cache-memory-bytes for more.
DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024


def _log(msg: str) -> None:
    print(f"[vllm_engine] {msg}", file=sys.stderr, flush=True)


def _prepare_env(argv: list[str]) -> list[str]:
    """Environment defaults that must be set before vLLM is imported; returns argv with the
    KV cap added when the caller gave none."""
    # vLLM logs to stdout by default; smgd reserves the child's stdout.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    cache = os.environ.get("SMGD_ENGINE_CACHE") or os.path.expanduser("~/.cache/smgd-engines")
    runtime = os.path.join(cache, "vllm-runtime")
    # The first logprobs request JIT-compiles with inductor (~14 s); a persistent cache makes
    # later engine starts skip it.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(runtime, "torchinductor"))
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(runtime, "vllm-cache"))
    os.environ.setdefault("VLLM_RPC_BASE_PATH", os.path.join(runtime, "rpc"))
    for key in ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT", "VLLM_RPC_BASE_PATH"):
        os.makedirs(os.environ[key], exist_ok=True)
    has_cap = any(a.startswith("--kv-cache-memory-bytes") for a in argv)
    if not has_cap and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        _log(f"no KV cache cap given; using --kv-cache-memory-bytes {DEFAULT_KV_CACHE_BYTES}")
        argv = [*argv, "--kv-cache-memory-bytes", str(DEFAULT_KV_CACHE_BYTES)]
    return argv


def main(argv: list[str]) -> int:
    argv = _prepare_env(argv)
    # vLLM lives only in the engine's venv: import by name so smgd's type checker need not
    # see it.
    AsyncEngineArgs = importlib.import_module("vllm.engine.arg_utils").AsyncEngineArgs
    UsageContext = importlib.import_module("vllm.usage.usage_lib").UsageContext
    parser_mod = importlib.import_module("vllm.utils.argparse_utils")
    EngineCoreProc = importlib.import_module("vllm.v1.engine.core").EngineCoreProc
    Executor = importlib.import_module("vllm.v1.executor").Executor

    parser = parser_mod.FlexibleArgumentParser(description="headless vLLM engine core for smgd")
    parser.add_argument("--handshake-address", required=True, help="smgd's handshake ROUTER")
    parser.add_argument(
        "--engine-index",
        type=int,
        default=0,
        help="ZMQ identity = index as 2 little-endian bytes; keep 0 unless running real DP",
    )
    parser.add_argument(
        "--remote",
        action="store_true",
        help="say local=false, headless=true in HELLO/READY, as `vllm serve --headless` does",
    )
    parser = AsyncEngineArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER, headless=True
    )
    _log(
        f"pid={os.getpid()} config ready after {time.monotonic() - T0:.1f}s; "
        f"connecting to {args.handshake_address}"
    )
    try:
        EngineCoreProc.run_engine_core(
            vllm_config=vllm_config,
            local_client=not args.remote,
            handshake_address=args.handshake_address,
            executor_class=Executor.get_class(vllm_config),
            log_stats=not engine_args.disable_log_stats,
            dp_rank=args.engine_index,
            local_dp_rank=args.engine_index,
        )
    except SystemExit as exc:  # SIGTERM/SIGINT end the busy loop with SystemExit
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except Exception as exc:  # vLLM already logged the traceback and sent ENGINE_CORE_DEAD
        _log(f"engine core failed: {type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":  # required: the CPU executor spawns its worker with multiprocessing
    sys.exit(main(sys.argv[1:]))

"""Start ONE headless SGLang 0.5.23 scheduler wired to smgd's two ipc sockets.

Run with the SGLang venv's python (this file must not import smgd)::

    python sglang_scheduler.py --smgd-input ipc:///run/x.in --smgd-output ipc:///run/x.out \
        [--cpu-shims] --model-path DIR --device cpu ... (any SGLang server args)

smgd binds PUSH at ``--smgd-input`` (the scheduler's request socket) and PULL at
``--smgd-output`` (where the scheduler sends outputs and control replies). The launcher forces
the msgpack wire (``SGLANG_USE_PICKLE_IPC=0``, set before sglang is imported), follows the same
start-up steps as SGLang's ``Engine`` (resolve args, ``_set_envs_and_config``, plugins,
``check_server_args``, ``publish``, ``PortArgs``) minus the tokenizer and detokenizer
processes, and spawns ``run_scheduler_process``. smgd is the tokenizer and the detokenizer: both
of the scheduler's output sockets point at ``--smgd-output``. The scheduler still loads the
model's tokenizer for its grammar backend (structured output compiles against the vocabulary),
unless ``--grammar-backend none`` (or ``--skip-tokenizer-init``) is given: then it runs with
``--skip-tokenizer-init`` and has no grammar backend. When the scheduler reports
ready it prints one line ``SMGD_READY {json}`` (max_total_num_tokens, max_req_input_len,
context_length, scheduler_pid) on stdout and waits. When the scheduler exits, for any reason,
the launcher exits too, with the scheduler's exit code (a signal N becomes 128+N); a clean exit
after ``ShutdownReq`` is 0. SIGTERM/SIGINT to the launcher stop the scheduler first. When the
launcher dies (smgd gone: see lifeline.py), the scheduler dies with it.

``--cpu-shims`` (or ``SMGD_SGLANG_CPU_SHIMS=1``) puts ``cpu_shims/`` (import-only stand-ins
for ``sgl_kernel`` and ``torchvision``) on the path of the launcher and the scheduler, and
``cpu_torch/`` (torch's pinned-memory requests dropped: SGLang's LoRA layers make them) on the
scheduler's, and sets ``SGLANG_USE_CPU_ENGINE=1`` unless already set: what a CPU-only machine
needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

SHIMS = Path(__file__).resolve().parent / "cpu_shims"
# Pinned-memory requests dropped without an accelerator (SGLang's LoRA layers make them):
# a sitecustomize, so it runs in the spawned scheduler process too.
CPU_TORCH = Path(__file__).resolve().parent / "cpu_torch"
# smgd started this process through lifeline.py: it dies with smgd. The scheduler it spawns
# (and anything that forks) must die with it; the kernel's death signal does not reach them,
# so they tie themselves when they import this file as __mp_main__ (as every multiprocessing
# child does). lifeline.py is next to this file, on sys.path as the script's directory;
# imported by name so smgd's type checker need not resolve it.
lifeline = importlib.import_module("lifeline")
if __name__ == "__mp_main__":
    lifeline.hold_parent()
lifeline.tie_children()
TERM_GRACE_S = 10.0  # after SIGTERM, how long the scheduler gets to exit before SIGKILL


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smgd-input", required=True, help="ipc endpoint smgd PUSHes requests to")
    parser.add_argument("--smgd-output", required=True, help="ipc endpoint smgd PULLs outputs from")
    parser.add_argument("--cpu-shims", action="store_true", help="use the CPU import shims")
    args, rest = parser.parse_known_args(argv)
    if "--skip-tokenizer-init" not in rest and _grammar_backend(rest) == "none":
        # No grammar backend: nothing in the scheduler needs the tokenizer (smgd is it).
        rest.append("--skip-tokenizer-init")
    return args, rest


def _grammar_backend(argv: list[str]) -> str | None:
    """The value of ``--grammar-backend`` in SGLang's args (None: SGLang's default, xgrammar)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == "--grammar-backend" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--grammar-backend="):
            value = arg.split("=", 1)[1]
    return value


def _use_shims() -> None:
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SHIMS), str(CPU_TORCH), os.environ.get("PYTHONPATH", "")) if p
    )
    sys.path.insert(0, str(SHIMS))
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")


def _context_length(server_args: Any) -> int | None:
    try:
        model_config = importlib.import_module("sglang.srt.configs.model_config")
        return int(model_config.ModelConfig.from_server_args(server_args).context_len)
    except Exception as exc:  # informational only: smgd falls back to the model dir
        print(f"[smgd-launcher] context length unknown: {exc!r}", file=sys.stderr)
        return None


def _exit_code(code: int | None) -> int:
    if code is None:
        return 1
    return 128 - code if code < 0 else code  # -N (killed by signal N) -> 128+N like a shell


def main(argv: list[str]) -> int:
    args, sglang_argv = _parse(argv)
    os.environ["SGLANG_USE_PICKLE_IPC"] = "0"  # the msgpack wire; read at sglang import
    if args.cpu_shims or os.environ.get("SMGD_SGLANG_CPU_SHIMS") == "1":
        _use_shims()

    import multiprocessing as mp

    # sglang lives only in the engine's venv; import by name so smgd's type checker need not
    # see it.
    engine = importlib.import_module("sglang.srt.entrypoints.engine")
    scheduler = importlib.import_module("sglang.srt.managers.scheduler")
    parsers = importlib.import_module("sglang.srt.parser.template_detection")
    plugins = importlib.import_module("sglang.srt.plugins")
    runtime_context = importlib.import_module("sglang.srt.runtime_context")
    sargs = importlib.import_module("sglang.srt.server_args")
    utils = importlib.import_module("sglang.srt.utils")

    started = time.monotonic()
    server_args = sargs.prepare_server_args(sglang_argv)
    utils.configure_logger(server_args)
    server_args.resolve_once()
    engine._set_envs_and_config(server_args)  # also: mp "spawn", SIGQUIT -> kill our tree
    plugins.load_plugins()
    server_args.check_server_args()
    parsers.resolve_auto_parsers(server_args)
    runtime_context.publish(server_args, role="tokenizer")
    port_args = dataclasses.replace(
        sargs.PortArgs.init_new(server_args),
        scheduler_input_ipc_name=args.smgd_input,
        tokenizer_ipc_name=args.smgd_output,
        # Without --skip-tokenizer-init the scheduler sends its outputs to the detokenizer,
        # in the same BatchTokenIDOutput frames: smgd is the detokenizer too.
        detokenizer_ipc_name=args.smgd_output,
    )
    reader, writer = mp.Pipe(duplex=False)
    proc = mp.Process(
        target=scheduler.run_scheduler_process,
        args=(server_args, port_args, 0, 0, 0, None, writer),  # gpu, tp, pp rank 0; no DP
    )
    proc.start()
    writer.close()  # so reader.recv() sees EOF if the scheduler dies during start-up

    def stop(signum: int, _frame: Any) -> None:
        if proc.is_alive():
            proc.terminate()
            proc.join(TERM_GRACE_S)
            if proc.is_alive():
                proc.kill()
        proc.join()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    try:
        info = reader.recv()
    except EOFError:
        proc.join()
        print(f"[smgd-launcher] scheduler died during start-up ({proc.exitcode})", file=sys.stderr)
        return _exit_code(proc.exitcode) or 1
    ready = {
        "max_total_num_tokens": info.get("max_total_num_tokens"),
        "max_req_input_len": info.get("max_req_input_len"),
        "context_length": _context_length(server_args),
        "scheduler_pid": proc.pid,
        "startup_s": round(time.monotonic() - started, 1),
    }
    print("SMGD_READY " + json.dumps(ready), flush=True)
    proc.join()
    print(f"[smgd-launcher] scheduler exited with {proc.exitcode}", file=sys.stderr)
    return _exit_code(proc.exitcode)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

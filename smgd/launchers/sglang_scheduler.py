"""Start ONE headless SGLang 0.5.23 scheduler wired to smgd's two ipc sockets.

Run with the SGLang venv's python (this file must not import smgd)::

    python sglang_scheduler.py --smgd-input ipc:///run/x.in --smgd-output ipc:///run/x.out \
        [--cpu-shims] --model-path DIR --device cpu ... (any SGLang server args)

smgd binds PUSH at ``--smgd-input`` (the scheduler's request socket) and PULL at
``--smgd-output`` (where the scheduler sends outputs and control replies). The launcher forces
the msgpack wire (``SGLANG_USE_PICKLE_IPC=0``, set before sglang is imported), follows the same
start-up steps as SGLang's ``Engine`` (resolve args, ``_set_envs_and_config``, plugins,
``check_server_args``, ``publish``, ``PortArgs``) minus the tokenizer and detokenizer
processes, then runs SGLang's ``run_scheduler_process`` in this very process: the process smgd
started IS the scheduler, with no launcher parent left holding torch and sglang. smgd is the
tokenizer and the detokenizer: both of the scheduler's output sockets point at
``--smgd-output``. The scheduler still loads the model's tokenizer for its grammar backend
(structured output compiles against the vocabulary), unless ``--grammar-backend none`` (or
``--skip-tokenizer-init``) is given: then it runs with ``--skip-tokenizer-init`` and has no
grammar backend. When the scheduler is ready the launcher prints one line ``SMGD_READY
{json}`` (max_total_num_tokens, max_req_input_len, context_length, scheduler_pid: this
process) on stdout. Exit codes: 0 after a ``ShutdownReq``; 1 when the scheduler fails (SGLang
signals "the parent" then; here that ends this process instead of reaching smgd); 128+N on
SIGTERM/SIGINT (N the signal). The scheduler dies with smgd (see lifeline.py), and so does
any process it starts.

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
# Pinned-memory requests dropped without an accelerator (SGLang's LoRA layers make them), in
# this process and (its sitecustomize) in any the scheduler starts.
CPU_TORCH = Path(__file__).resolve().parent / "cpu_torch"
# smgd started this process through lifeline.py: it dies with smgd. Any process the scheduler
# starts (none on one CPU rank; helpers on others) must die with it; the kernel's death signal
# does not reach them,
# so they tie themselves when they import this file as __mp_main__ (as every multiprocessing
# child does). lifeline.py is next to this file, on sys.path as the script's directory;
# imported by name so smgd's type checker need not resolve it.
lifeline = importlib.import_module("lifeline")
if __name__ == "__mp_main__":
    lifeline.hold_parent()
lifeline.tie_children()
EXIT_SCHEDULER_FAILED = 1  # the scheduler raised (or its watchdog fired): SGLang logged why


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
    sys.path.insert(0, str(CPU_TORCH))
    importlib.import_module("smgd_unpinned")  # this process runs the scheduler itself
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")


def _context_length(server_args: Any) -> int | None:
    try:
        model_config = importlib.import_module("sglang.srt.configs.model_config")
        return int(model_config.ModelConfig.from_server_args(server_args).context_len)
    except Exception as exc:  # informational only: smgd falls back to the model dir
        print(f"[smgd-launcher] context length unknown: {exc!r}", file=sys.stderr)
        return None


class _ReadyReport:
    """Where ``run_scheduler_process`` sends its init info: the ``SMGD_READY`` line on stdout.

    SGLang hands the scheduler one end of a pipe to its parent; here the scheduler runs in
    this process, so the report goes straight to smgd.
    """

    def __init__(self, context_length: int | None, started: float) -> None:
        self.context_length = context_length
        self.started = started

    def send(self, info: dict[str, Any]) -> None:
        ready = {
            "max_total_num_tokens": info.get("max_total_num_tokens"),
            "max_req_input_len": info.get("max_req_input_len"),
            "context_length": self.context_length,
            "scheduler_pid": os.getpid(),
            "startup_s": round(time.monotonic() - self.started, 1),
        }
        print("SMGD_READY " + json.dumps(ready), flush=True)


class _NoParent:
    """Stands in for "the parent process" SGLang signals when the scheduler fails.

    SGLang's scheduler (and its watchdog) send SIGQUIT to their parent on an error, expecting
    a launcher that then tears the tree down. Here the parent is smgd itself, which must not
    get it: the failure ends this process instead, with :data:`EXIT_SCHEDULER_FAILED`, and
    smgd sees the engine die.
    """

    pid = 0

    def send_signal(self, _sig: int) -> None:
        print("[smgd-launcher] scheduler failed; exiting", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_SCHEDULER_FAILED)


def _keep_signals_from_smgd(psutil: Any) -> None:
    """Make ``psutil.Process().parent()`` of this process the :class:`_NoParent` stand-in."""
    real_parent = psutil.Process.parent

    def parent(self: Any) -> Any:
        return _NoParent() if self.pid == os.getpid() else real_parent(self)

    psutil.Process.parent = parent


def _exit_on(signum: int, _frame: Any) -> None:
    # The scheduler holds nothing that outlives it (smgd owns the sockets): stop at once,
    # with the shell's code for the signal, as a launcher that waited on it would report.
    sys.stderr.flush()
    os._exit(128 + signum)


def main(argv: list[str]) -> int:
    """Set up as SGLang's ``Engine`` does, then run the scheduler in THIS process.

    No parent stays behind holding torch and sglang (~590 MiB before): the process smgd
    started (through lifeline.py) is the scheduler, and its exit code is the scheduler's.
    """
    args, sglang_argv = _parse(argv)
    os.environ["SGLANG_USE_PICKLE_IPC"] = "0"  # the msgpack wire; read at sglang import
    if args.cpu_shims or os.environ.get("SMGD_SGLANG_CPU_SHIMS") == "1":
        _use_shims()

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
    engine._set_envs_and_config(server_args)  # also: SIGQUIT -> kill this process's tree
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
    report = _ReadyReport(_context_length(server_args), started)
    _keep_signals_from_smgd(importlib.import_module("psutil"))
    signal.signal(signal.SIGTERM, _exit_on)
    signal.signal(signal.SIGINT, _exit_on)
    # gpu, tp, pp rank 0; no DP. Returns after a ShutdownReq (or after logging an exception
    # that did not end the process through _NoParent).
    scheduler.run_scheduler_process(server_args, port_args, 0, 0, 0, None, report)
    print("[smgd-launcher] scheduler exited", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

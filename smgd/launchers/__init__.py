"""Scripts that start real engines next to smgd.

Each launcher runs with the *engine's* Python (its own venv), so it must not import smgd. smgd
starts it as a child process by file path (``sglang_scheduler_script()``) and supervises it by PID.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def sglang_scheduler_script() -> Path:
    """Path of the headless SGLang scheduler launcher, to run with the SGLang venv's python."""
    return _HERE / "sglang_scheduler.py"


def cpu_shims_dir() -> Path:
    """Directory to put on ``PYTHONPATH`` for SGLang on a CPU-only machine (import-only shims)."""
    return _HERE / "cpu_shims"


def cpu_torch_dir() -> Path:
    """Directory to put on ``PYTHONPATH`` with :func:`cpu_shims_dir`: torch's pinned-memory
    requests are dropped without an accelerator (SGLang's LoRA layers make them)."""
    return _HERE / "cpu_torch"

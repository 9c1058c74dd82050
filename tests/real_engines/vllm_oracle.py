"""Recording a corpus with vLLM itself, now, for the oracle tests (test_chat_oracle.py and
test_parse_oracle.py).

Each corpus has a ``make_expected.py`` that runs in the vLLM venv (``.ci/vllm-env.sh``) and
writes what vLLM does with every case. :func:`record` runs it into a fresh file; the
committed ``expected.json`` must still say the same (:func:`assert_unchanged`), so the plain
unit tests, which check smgd against that file, check it against what vLLM really does.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A recording imports vLLM (~20 s here) and runs the corpus (under a minute); ten minutes is
# a hang, not a slow machine.
RECORD_TIMEOUT_S = 600


def record(script: Path, out_dir: Path) -> dict[str, Any]:
    """Runs ``script`` with the vLLM venv's Python; the record it wrote into ``out_dir``."""
    python = os.environ.get("VLLM_PYTHON")
    if not python:
        pytest.fail('VLLM_PYTHON unset: run `set -a; eval "$(bash .ci/vllm-env.sh)"; set +a` first')
    out = out_dir / "expected.json"
    subprocess.run([python, str(script), str(out)], check=True, timeout=RECORD_TIMEOUT_S)
    fresh: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return fresh


def assert_unchanged(fresh: dict[str, Any], committed: dict[str, Any], script: Path) -> None:
    """The record made now is the committed one: the versions and the other top-level fields
    first, then case by case, so a failure names the cases vLLM now treats differently."""
    # (pytest does not rewrite asserts in this helper: the messages say what differs)
    fields = sorted((fresh.keys() | committed.keys()) - {"cases"})
    differ = {
        k: (fresh.get(k), committed.get(k)) for k in fields if fresh.get(k) != committed.get(k)
    }
    assert not differ, f"the recording differs in {sorted(differ)} (now, committed): {differ}"
    changed = [cid for cid, case in fresh["cases"].items() if committed["cases"].get(cid) != case]
    assert not changed, (
        f"vLLM's results changed for {changed}: rerun "
        f"`$VLLM_PYTHON {script.resolve().relative_to(ROOT)}` and review the diff"
    )
    gone = sorted(committed["cases"].keys() - fresh["cases"].keys())
    assert not gone, f"vLLM's recording no longer has the cases {gone}"
    # and to the letter (== takes 1 for 1.0 and True)
    assert json.dumps(fresh, sort_keys=True) == json.dumps(committed, sort_keys=True)

"""The result an engine's own front end (an oracle script run in the engine's venv) reports.

Each oracle script (``*_offline_*.py``) prints its answer as one JSON line after ``RESULT ``,
among whatever the engine logs to the same stream; the last such line counts.
"""

from __future__ import annotations

import json
from typing import Any

RESULT_PREFIX = "RESULT "


def oracle_result(output: str, *, ok: bool = True, diagnostics: str = "") -> dict[str, Any]:
    """The last ``RESULT`` line of ``output``, decoded. Fails the test, showing the tail of
    ``diagnostics`` (default: ``output``), when the script failed (``ok`` false) or wrote none."""
    lines = [ln for ln in output.splitlines() if ln.startswith(RESULT_PREFIX)]
    assert ok and lines, (diagnostics or output)[-3000:]
    result: dict[str, Any] = json.loads(lines[-1][len(RESULT_PREFIX) :])
    return result

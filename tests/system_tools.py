"""Real programs from Debian that some slow tests drive (a browser, a load balancer, promtool).

``.ci/system-packages`` installs them for CI. Outside CI a missing program skips its test with
the install line; under ``CI=true`` it fails, so a green CI never hides an untested path.
"""

from __future__ import annotations

import os
import shutil

import pytest


def require_program(name: str, debian_package: str) -> str:
    """The program's path, or skip (fail under CI) naming the Debian package that brings it."""
    path = shutil.which(name)
    if path is not None:
        return path
    reason = f"{name} not installed (apt-get install {debian_package}; .ci/system-packages does it)"
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)

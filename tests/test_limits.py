"""The daemon's open-files limit (smgd.limits): what it raises the soft limit to, and that it
does, in a real process."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from smgd.limits import UNLIMITED_CAP, open_files_target

INF = resource.RLIM_INFINITY


@pytest.mark.parametrize(
    ("soft", "hard", "target"),
    [
        (1024, 524288, 524288),  # systemd's default: up to the hard limit
        (1024, INF, UNLIMITED_CAP),  # unlimited: as far as the cap
        (256, 256, 256),  # nothing to raise
        (2_000_000, INF, 2_000_000),  # already over the cap: never lowered
        (INF, INF, INF),
    ],
)
def test_the_soft_limit_goes_to_the_hard_one_and_never_down(
    soft: int, hard: int, target: int
) -> None:
    assert open_files_target(soft, hard) == target


def _limits_after_raising(soft: int) -> tuple[int, int, int]:
    """(returned, soft, hard) in a fresh process that starts at ``soft`` and raises."""
    code = (
        "import resource; from smgd.limits import raise_open_files_limit as r\n"
        "_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, hard))\n"
        "got = r(); print(got, *resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    returned, now_soft, now_hard = (int(x) for x in out)
    return returned, now_soft, now_hard


def test_a_process_started_at_a_low_soft_limit_runs_at_the_hard_one() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != INF and hard <= 256:
        pytest.skip(f"the hard limit here is {hard}: nothing to raise")
    returned, soft, now_hard = _limits_after_raising(256)
    assert soft == returned == open_files_target(256, hard)
    assert now_hard == hard  # the hard limit is the administrator's: untouched

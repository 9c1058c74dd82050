"""Helpers for tests that watch trio's scheduler."""

from __future__ import annotations

import trio


class TaskSteps(trio.abc.Instrument):
    """Counts the scheduler passes of the tasks whose name ends with ``suffix``."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith(self.suffix):
            self.steps += 1

"""Shared fixtures."""

from __future__ import annotations

import pytest
import trio.testing

# Real ipc sockets complete their connects on libzmq's I/O thread, which trio cannot see: with
# a zero threshold the clock would jump past every timeout before a connect lands. 50 ms of
# real idleness is far above a loopback connect and far below any timeout the tests exercise.
SOCKET_AUTOJUMP_THRESHOLD_S = 0.05


@pytest.fixture
def socket_autojump_clock() -> trio.testing.MockClock:
    """trio's autojump clock for tests with real sockets (see the threshold's comment)."""
    return trio.testing.MockClock(autojump_threshold=SOCKET_AUTOJUMP_THRESHOLD_S)

"""Pure helpers shared by the load generator, the floor and the report: percentiles and the
lost/duplicated-token check.

The mock engine echoes the prompt, so every stream's exact text is known in advance. A
stream's received text is compared with it; when they differ, the whole tokens that match are
counted from the cumulative character length after each expected token (``prefix_lens``), and
the unmatched tail is converted to tokens at the expected text's average characters per token.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def prefix_lengths(pieces: Sequence[str]) -> list[int]:
    """Cumulative character counts after each token's text piece."""
    out: list[int] = []
    total = 0
    for piece in pieces:
        total += len(piece)
        out.append(total)
    return out


def tokens_in(prefix_lens: Sequence[int], chars: int) -> int:
    """How many whole expected tokens ``chars`` characters of correct text hold."""
    return bisect_right(prefix_lens, chars)


def token_errors(received: str, expected: str, prefix_lens: Sequence[int]) -> tuple[int, int, bool]:
    """``(lost, duplicated, corrupt)`` for one stream's text against the expected echo.

    The longest common prefix and suffix (in whole expected tokens) are taken as delivered;
    the expected tokens between them against the received characters between them, at the
    average characters per token, give the lost or duplicated count (an estimate for
    mid-stream damage, exact for truncation). ``corrupt`` is true whenever the text differs.
    """
    if received == expected:
        return 0, 0, False
    m = len(prefix_lens)
    limit = min(len(received), len(expected))
    n = 0
    while n < limit and received[n] == expected[n]:
        n += 1
    k = tokens_in(prefix_lens, n)
    head = prefix_lens[k - 1] if k else 0
    room = min(len(received), len(expected)) - head
    s = 0
    while s < room and received[-1 - s] == expected[-1 - s]:
        s += 1
    starts = [0, *prefix_lens[:-1]]
    j = bisect_left(starts, len(expected) - s)  # first expected token wholly inside the suffix
    tail = len(expected) - starts[j] if j < m else 0
    expected_mid = max(0, j - k)
    received_chars = max(0, len(received) - head - tail)
    chars_per_token = len(expected) / m if m else 1.0
    received_mid = math.ceil(received_chars / chars_per_token)
    return max(0, expected_mid - received_mid), max(0, received_mid - expected_mid), True

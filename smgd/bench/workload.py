"""What one benchmark run offers: the workload knobs and the exact prompt every stream sends.

The prompt is ``P`` token ids of plain English from the model's own tokenizer, with no special
ids, so the mock engine (which echoes the prompt cyclically, skipping special ids) produces a
known output: :class:`Prompt` carries the expected ids, text and per-token prefix lengths
that the lost/duplicated-token check compares against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from smgd.bench.stats import prefix_lengths

if TYPE_CHECKING:
    from pathlib import Path

_TEXT = (
    "The quick brown fox jumps over the lazy dog while the early bird catches the worm, "
    "and a stitch in time saves nine when every cloud has a silver lining. "
)
# How long one request may take beyond its ideal time before the hard limit fires: generous,
# because the point of the limit is to bound a hung run, not to judge latency.
_TIME_LIMIT_SLACK = 3.0
_TIME_LIMIT_FLOOR_S = 30.0


@dataclass(frozen=True, slots=True)
class Workload:
    step_ms: float = 20.0
    max_batch: int = 256
    prompt_tokens: int = 64
    max_tokens: int = 128
    duration_s: float = 10.0

    def mock_args(self, skip_ids: str) -> list[str]:
        """The mock engine's flags for this workload (step time, batch, never-echoed ids)."""
        return [
            "--step-ms", str(self.step_ms),
            "--max-batch", str(self.max_batch),
            "--skip-ids", skip_ids,
        ]  # fmt: skip

    def offered_tokens_per_s(self, concurrency: int) -> float:
        """What the engine can produce for C streams: one token per running stream per step."""
        return min(concurrency, self.max_batch) * 1000.0 / self.step_ms

    def request_s(self, concurrency: int) -> float:
        """Ideal time of one request at C in flight (queueing when C exceeds the batch)."""
        waves = math.ceil(concurrency / self.max_batch)
        return waves * self.max_tokens * self.step_ms / 1000.0

    def max_requests(self, concurrency: int) -> int:
        """A count bound just above what the duration allows, so both bounds hold."""
        per_stream = math.ceil(self.duration_s / self.request_s(concurrency)) + 1
        return concurrency * per_stream

    def time_limit_s(self, concurrency: int) -> float:
        ideal = self.duration_s + self.request_s(concurrency)
        return max(_TIME_LIMIT_FLOOR_S, ideal * _TIME_LIMIT_SLACK)


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: list[int]
    expected_ids: list[int]
    expected_text: str
    prefix_lens: list[int]


def build_prompt(model_dir: str | Path, prompt_tokens: int, max_tokens: int) -> Prompt:
    """``prompt_tokens`` ids of plain text and the echo the mock engine will stream back."""
    from smgd.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    specials = tok.special_ids
    text = _TEXT
    ids: list[int] = []
    while len(ids) < prompt_tokens:
        ids = [t for t in tok.encode(text, add_special_tokens=False) if t not in specials]
        text += _TEXT
    ids = ids[:prompt_tokens]
    expected = [ids[i % len(ids)] for i in range(max_tokens)]
    pieces: list[str] = []
    prev = ""
    for k in range(1, max_tokens + 1):
        cur = tok.decode(expected[:k])
        pieces.append(cur[len(prev) :])
        prev = cur
    full = tok.decode(expected)
    if "".join(pieces) != full or any(not p for p in pieces):
        raise ValueError("prompt tokens do not decode to clean per-token text pieces")
    return Prompt(
        ids=ids, expected_ids=expected, expected_text=full, prefix_lens=prefix_lengths(pieces)
    )

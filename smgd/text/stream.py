"""``TextStream``: one request's output text, from token-id deltas to client-ready text.

Chains the incremental detokenizer and the stop-string matcher. The API handler makes one per
choice, calls ``push`` for each engine delta and ``finish`` when the engine says it is done (or
when ``push`` reported a stop hit, after which it aborts the engine request).

A delta may hold several tokens (the engine batched them, or smgd coalesced deltas for a slow
reader). When a stop string completes inside one, the output ends at the token that completed
it, as with an engine that checks stops after every token: ``kept`` says how many of the
delta's ids that is, so usage, ``output_ids`` and logprobs drop the rest.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate
from typing import TYPE_CHECKING

from smgd.text.detok import IncrementalDetokenizer
from smgd.text.stops import StopMatcher

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tokenizers import Tokenizer as HfTokenizer

    from smgd.text.tokenizer import Tokenizer

__all__ = ["TextStream"]


class TextStream:
    """Per-request text pipeline: ``push(ids) -> (text, stop_hit)``, then ``finish()``."""

    def __init__(
        self,
        tokenizer: Tokenizer | HfTokenizer,
        *,
        stops: Sequence[str] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] | None = None,
        keep_held: bool = True,
    ) -> None:
        self.detok = IncrementalDetokenizer(
            tokenizer,
            skip_special_tokens=skip_special_tokens,
            prompt_ids=prompt_ids,
            keep_held=keep_held,
        )
        self.stops = StopMatcher(stops, include_stop=include_stop)
        self._include_stop = include_stop
        # No stop strings: the matcher would hand every text through as it is, so push()
        # skips it (two calls per token fewer on the hot path). While no finish comes, push()
        # is then ``detok.push()``, which a caller may call itself (Choice.apply does).
        self._no_stops = self.plain = not self.stops.stops
        # After a push() that reported a stop hit: how many of its ids were generated up to
        # and including the one that completed the stop.
        self.kept = 0

    @property
    def stop_hit(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self.stops.hit

    def push(self, token_ids: Sequence[int], *, stop_token: bool = False) -> tuple[str, str | None]:
        """Feed new ids; return (text to send, stop string if one matched in it).

        ``stop_token``: the last id is the EOS / stop token id that ended the request
        (``Finish.matched_token``); like vLLM, its text is not part of the output unless
        stop strings are included (``include_stop``).
        """
        if stop_token and token_ids and not self._include_stop:
            token_ids = token_ids[:-1]
        if self._no_stops:
            return self.detok.push(token_ids), None
        if self.stops.hit is not None:
            return "", None
        if len(token_ids) < 2:
            text, hit = self.stops.feed(self.detok.push(token_ids))
            if hit is not None:
                self.kept = 1
            return text, hit
        # Several ids: detokenized one at a time to know where each one's text ends, so a
        # stop can be traced to the id that completed it.
        pieces = self.detok.push_each(token_ids)
        text, hit = self.stops.feed("".join(pieces))
        if hit is not None:
            self.kept = bisect_left(list(accumulate(map(len, pieces))), self.stops.hit_end) + 1
        return text, hit

    def finish(self) -> str:
        """Final text: held-back bytes and characters. Check ``stop_hit`` afterwards."""
        if self.stops.done:
            return ""
        text, _ = self.stops.feed(self.detok.flush())
        return text + self.stops.flush()

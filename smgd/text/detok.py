"""Incremental detokenization: token-id deltas in, new text out, O(new tokens) per step.

Every path holds back a character split across tokens instead of streaming it as ``"�"``:
text is returned once it does not end inside a character.

For byte-level BPE vocabularies (:mod:`smgd.text.bytelevel`) the ids' bytes come from a table
and the held bytes are decoded as UTF-8 on each step: what ``DecodeStream`` returns, at a
tenth of its cost. Elsewhere the path is ``tokenizers.decoders.DecodeStream`` (Rust): it keeps
a small window of ids and returns ``None`` while the newest bytes do not yet form a complete
UTF-8 character.

The fallback is the classic prefix/read-offset scheme (vLLM's slow path, HF ``TextStreamer``):
decode the short window ``ids[prefix:]`` and emit what extends ``ids[prefix:read]``'s text.
It is used when DecodeStream raises (``"Invalid prefix encountered"`` for decoders whose output
is not prefix-stable, e.g. some Metaspace/cleanup setups) or is disabled.

``flush()`` at the end returns whatever is still held (an incomplete character at the very
end decodes to ``"�"``, exactly as a one-shot ``decode`` of the whole output would), as SGLang's
detokenizer does; with ``keep_held=False`` it drops it, as vLLM's does (its output text is
what its incremental steps emitted, and a step ending in an unfinished character emits nothing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

from smgd.text.tokenizer import MAX_TOKEN_ID, Tokenizer

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tokenizers import Tokenizer as HfTokenizer

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
# Ids of already-emitted context decoded together with new ids by the fallback and by
# flush(): enough for a decoder to see the previous word boundary (vLLM uses 5).
_CONTEXT_IDS = 6
# Prompt priming (for decoders that strip a leading space on the first token): try prompt
# suffixes of this many ids, shortest first, and use the first that decodes without "�"
# (the range vLLM's FastIncrementalDetokenizer searches).
_PRIME_MIN, _PRIME_MAX = 4, 24


class IncrementalDetokenizer:
    """Per-request detokenizer. ``push(ids)`` returns the text those ids completed."""

    def __init__(
        self,
        tokenizer: Tokenizer | HfTokenizer,
        *,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] | None = None,
        use_decode_stream: bool = True,
        use_byte_table: bool = True,
        keep_held: bool = True,
    ) -> None:
        """``use_byte_table``: the byte table where the tokenizer has one (a smgd
        :class:`Tokenizer` of a byte-level vocabulary); else ``use_decode_stream``:
        ``DecodeStream``, else the windowed fallback (the last two for tests)."""
        self._hf = tokenizer.hf if isinstance(tokenizer, Tokenizer) else tokenizer
        self._keep_held = keep_held  # flush(): return the held text, or drop it
        self._skip = skip_special_tokens
        byte_level = (
            tokenizer.byte_level if use_byte_table and isinstance(tokenizer, Tokenizer) else None
        )
        # The byte table, and the ids whose text is not out yet with their bytes (on the table's
        # path only). That path keeps no list of every id: a token's append to a per-request
        # list is a cache line more per token, cold after an engine step, and the held ids
        # (a character split across tokens) are all flush() needs.
        self._table = None if byte_level is None else byte_level.table(skip_special_tokens)
        self._whole = {} if byte_level is None else byte_level.whole_texts(skip_special_tokens)
        self._held = b""
        # None rather than an empty list while nothing is held: the test on nearly every
        # token then reads this object's own slot, not a list object of its own (cold).
        self._held_ids: list[int] | None = None
        self._table_count = 0  # ids pushed on the table's path
        # A byte-level text does not depend on the ids before it: no priming.
        prime = self._prime_ids(prompt_ids) if prompt_ids and self._table is None else []
        self._ids: list[int] = list(prime)  # primed prompt suffix + every output id
        self._base = len(prime)
        self._emitted = len(prime)  # ids[:_emitted] have had all their text returned
        self._stream: DecodeStream | None = None
        if use_decode_stream and self._table is None:
            self._stream = DecodeStream(ids=prime or None, skip_special_tokens=skip_special_tokens)
        # Fallback offsets (valid whenever _stream is None).
        self._prefix = max(self._base, self._emitted - _CONTEXT_IDS)
        self._read = self._emitted

    @property
    def num_tokens(self) -> int:
        """Output ids pushed so far."""
        return self._table_count + len(self._ids) - self._base

    @property
    def using_fallback(self) -> bool:
        return self._stream is None and self._table is None

    def _prime_ids(self, prompt_ids: Sequence[int]) -> list[int]:
        """A prompt suffix that decodes without "�" (or none): DecodeStream primed with ids
        whose text ends inside a character emits their whole text again on its first step."""
        for n in range(min(len(prompt_ids), _PRIME_MIN), min(len(prompt_ids), _PRIME_MAX) + 1):
            suffix = list(prompt_ids[-n:])
            if _REPLACEMENT not in self._decode(suffix):
                return suffix
        return []

    def _decode(self, ids: list[int]) -> str:
        try:
            return str(self._hf.decode(ids, skip_special_tokens=self._skip))
        except OverflowError:  # an id no vocabulary has (negative, past u32), from the engine
            # Nothing for it, as for an id past the vocabulary: the tokenizer skips those.
            return str(self._hf.decode(_in_range(ids), skip_special_tokens=self._skip))

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new output ids; return the newly completed text (possibly ``""``)."""
        if not token_ids:
            return ""
        table = self._table
        if table is not None:
            self._table_count += len(token_ids)
            # Ids outside the table decode to nothing, as in the tokenizer's own decode.
            if len(token_ids) == 1:  # nearly every step
                token_id = token_ids[0]
                if self._held_ids is None:
                    # Nearly every token of most text: an id that is whole characters alone,
                    # met before. Its text without a bytes join and a UTF-8 decode.
                    whole = self._whole.get(token_id)
                    if whole is not None:
                        return whole
                    if 0 <= token_id < len(table):
                        return self._first_time(token_id, table[token_id])
                held = self._held + table[token_id] if 0 <= token_id < len(table) else self._held
            else:
                size = len(table)
                held = self._held + b"".join([table[i] for i in token_ids if 0 <= i < size])
            return self._decode_held(held, token_ids)
        self._ids.extend(token_ids)
        if self._stream is not None:
            try:
                # The wire decoders give lists; anything else is copied into one.
                ids = token_ids if type(token_ids) is list else list(token_ids)
                step = self._stream.step(self._hf, ids)
            except Exception:  # DecodeStream's Rust errors are plain Exceptions
                return self._to_fallback()
            if step is None:
                return ""
            self._emitted = len(self._ids)
            return step
        return self._fallback_step()

    def _decode_held(self, held: bytes, token_ids: Sequence[int]) -> str:
        """The text of the held bytes plus the new ones of ``token_ids`` (table path), unless
        it would end inside a character: then they are all held and the text is ``""``."""
        text = held.decode("utf-8", "replace")
        if not text or text[-1] == _REPLACEMENT:  # nothing yet, or inside a character
            self._held = held
            if self._held_ids is None:
                self._held_ids = list(token_ids)
            else:
                self._held_ids.extend(token_ids)
            return ""
        self._held = b""
        self._held_ids = None
        return text

    def _first_time(self, token_id: int, piece: bytes) -> str:
        """:meth:`_decode_held` of one id with nothing held, which fills the shared cache."""
        text = self._decode_held(piece, (token_id,))
        if text:
            self._whole[token_id] = text
        return text

    def push_each(self, token_ids: Sequence[int]) -> list[str]:
        """``push`` of each id in turn: the text each one completed, in order.

        One call per id costs more than one ``push`` of them all (0.5 vs 0.25 µs per id on
        the 2-core test VM, stepping DecodeStream with a bare int), so only a caller that must
        know which id produced which text uses it.
        """
        stream = self._stream
        if stream is None:
            return [self.push((token_id,)) for token_id in token_ids]
        out: list[str] = []
        hf, ids = self._hf, self._ids
        for k, token_id in enumerate(token_ids):
            ids.append(token_id)
            try:
                text = stream.step(hf, token_id)
            except Exception:  # as in push(): the rest goes through the fallback
                out.append(self._to_fallback())
                out.extend(self.push((t,)) for t in token_ids[k + 1 :])
                return out
            if text is None:
                out.append("")
            else:
                self._emitted = len(ids)
                out.append(str(text))
        return out

    def _to_fallback(self) -> str:
        """DecodeStream failed on the ids just added: continue (and retry them) without it."""
        self._stream = None
        self._prefix = max(self._base, self._emitted - _CONTEXT_IDS)
        self._read = self._emitted
        return self._fallback_step()

    def _fallback_step(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if len(full) <= len(prefix_text) or full.endswith(_REPLACEMENT):
            return ""
        self._prefix = self._read
        self._read = self._emitted = len(self._ids)
        return full[len(prefix_text) :]

    def flush(self) -> str:
        """Text of ids still held back: an unfinished character at the end decodes to ``"�"``;
        without ``keep_held`` it is dropped, and the text stops after the last id that did not
        end inside a character."""
        if self._table is not None:
            return self._flush_bytes() if self._held_ids is not None else ""
        if self._emitted >= len(self._ids):
            return ""
        held = self._emitted
        start = max(self._base, held - _CONTEXT_IDS)
        end = len(self._ids) if self._keep_held else self._complete_end(start, held)
        # Terminal: later pushes (there should be none) continue on the fallback path.
        self._stream = None
        self._prefix, self._read = start, len(self._ids)
        self._emitted = len(self._ids)
        if end == held:
            return ""
        head = self._decode(self._ids[start:held])
        full = self._decode(self._ids[start:end])
        if not self._keep_held and full.endswith(_REPLACEMENT):
            return ""  # the short window below said complete, the whole text does not
        if full.startswith(head):
            return full[len(head) :]
        return self._decode(self._ids[held:end])

    def _flush_bytes(self) -> str:
        """flush() on the byte table's path. Without ``keep_held`` the text ends after the
        last held id that did not end inside a character (as in :meth:`_complete_end`): a
        character is at most 4 bytes, so whether a text ends inside one shows in its last 4
        bytes (a lead byte starts a character whatever precedes it)."""
        held, table, ids = self._held, self._table, self._held_ids or []
        assert table is not None
        self._held, self._held_ids = b"", None
        if self._keep_held:
            return held.decode("utf-8", "replace")
        end = len(held)
        for token_id in reversed(ids):
            if end and held[max(0, end - 4) : end].decode("utf-8", "replace")[-1] != _REPLACEMENT:
                return held[:end].decode("utf-8", "replace")
            end -= len(table[token_id]) if 0 <= token_id < len(table) else 0
        return ""

    def _complete_end(self, start: int, held: int) -> int:
        """Where flush()'s text ends without ``keep_held``: after the last id whose text did
        not end inside a character (``held`` if none).

        vLLM steps its detokenizer one id at a time and its text is what the steps emitted,
        so it keeps every id up to the last one whose text was complete. Ids arrive here in
        batches whose size depends on timing, and a batch ending inside a character is held
        whole: walking back to that id keeps the text from depending on the batching. Whether
        a text ends inside a character shows in its last few ids (a character is at most 4
        bytes), so each step decodes a short window, not the whole held run: a long run of
        stray bytes costs a pass over it, not one per id.
        """
        end = len(self._ids)
        while end > held:
            window = self._ids[max(start, end - _CONTEXT_IDS) : end]
            text = self._decode(window)
            # A window of ids with no text (skipped specials) says nothing of the text before
            # it: taken for complete, it hid a character left unfinished before it, and the
            # whole held text was dropped with it ('!' of '!' + a stray byte + specials).
            if text and not text.endswith(_REPLACEMENT):
                break
            end -= 1
        return end


def _in_range(ids: Sequence[int]) -> list[int]:
    return [i for i in ids if 0 <= i <= MAX_TOKEN_ID]

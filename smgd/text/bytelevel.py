"""Each token id's bytes, for tokenizers whose decoder is byte-level BPE's and nothing else.

GPT-2, Llama 3, Qwen and most recent models decode with ``tokenizers``' ``ByteLevel`` decoder:
every token stands for a fixed byte string (its characters mapped back through GPT-2's
byte-to-character alphabet, or its own UTF-8 bytes where a character is outside that
alphabet, as added tokens' often are), and decoding ids is concatenating their bytes and
reading them as UTF-8 with ``U+FFFD`` for what is not valid. So an incremental detokenizer
needs no decoder at all: a table lookup per id and one ``bytes.decode`` per step do what
``DecodeStream.step`` does, at about a tenth of its cost (0.1 against 0.85-0.95 µs per token
on the 2-core test VM, on the tiny and the 128k vocabularies; docs/performance.md, "Issue
21, sixth pass").

The table is only used where it is right: :meth:`ByteLevelVocab.of` returns None unless the
tokenizer's decoder is a plain ``ByteLevel``, and checks the table against the tokenizer's
own ``decode`` (with and without skipping special tokens) for every added token, for
thousands of sampled ids and for sequences across character and added-token boundaries.
Pure and synchronous; built once per tokenizer.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from tokenizers import decoders

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HfTokenizer

__all__ = ["ByteLevelVocab"]

# What ByteLevelVocab.of checks against the tokenizer's own decode besides every added token:
# single ids (each kind of piece: ASCII, multi-byte, a fragment of a character, many times
# over) and random sequences (each kind of boundary: inside a character, at an added token,
# at a skipped special token), in ~10 ms.
_CHECK_SINGLES = 4096
_CHECK_SEQUENCES = 512
_CHECK_LENGTH = 12


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's map from the 256 printable stand-in characters to the bytes they stand for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {byte: byte for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + extra
            extra += 1
    return {chr(char): byte for byte, char in chars.items()}


_ALPHABET = _byte_alphabet()
# str.translate table: an alphabet character becomes the Latin-1 character of its byte; a
# character below 256 that is not in the alphabet becomes U+FFFF, which Latin-1 cannot
# encode, as cannot every other character outside the alphabet.
_TO_LATIN1 = dict.fromkeys(range(256), 0xFFFF) | {
    ord(char): byte for char, byte in _ALPHABET.items()
}


def token_bytes(token: str) -> bytes:
    """The bytes ``ByteLevel`` decodes ``token`` to: its characters mapped through the
    alphabet, or, when one of them is outside it, the token's own UTF-8."""
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


class ByteLevelVocab:
    """Token id -> bytes, one table with special tokens and one without (skipped)."""

    __slots__ = ("_whole", "size", "with_special", "without_special")

    def __init__(self, with_special: list[bytes], special_ids: frozenset[int]) -> None:
        self.size = len(with_special)
        self.with_special = with_special
        self.without_special = [
            b"" if i in special_ids else piece for i, piece in enumerate(with_special)
        ]
        # Per skip_special_tokens: see whole_texts().
        self._whole: tuple[dict[int, str], dict[int, str]] = ({}, {})

    def table(self, skip_special_tokens: bool) -> list[bytes]:
        return self.without_special if skip_special_tokens else self.with_special

    def whole_texts(self, skip_special_tokens: bool) -> dict[int, str]:
        """A cache the detokenizers share and fill: id -> its text, for ids whose bytes alone
        are whole characters (non-empty text, not ending in a partial one).

        Filled as ids occur, not up front: text for every id of a 128k vocabulary would hold
        ~8 MB, most of it for ids a deployment never generates.
        """
        return self._whole[skip_special_tokens]

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """What the tokenizer's ``decode`` returns (ids outside the vocabulary decode to
        nothing, as there)."""
        table, size = self.table(skip_special_tokens), self.size
        return b"".join(table[i] for i in ids if 0 <= i < size).decode("utf-8", "replace")

    @classmethod
    def of(cls, hf: HfTokenizer) -> ByteLevelVocab | None:
        """The table for ``hf``, or None where its decoder is not (exactly) byte-level.

        ~0.1 s for a 128k vocabulary (a third of loading it): the gateway builds it when it
        loads a tokenizer, not on a request (:attr:`smgd.text.tokenizer.Tokenizer.byte_level`).
        """
        if type(hf.decoder) is not decoders.ByteLevel:
            return None
        added = hf.get_added_tokens_decoder()
        size = max([hf.get_vocab_size(with_added_tokens=True) - 1, *added]) + 1
        to_token = hf.id_to_token
        pieces = [
            b"" if (token := to_token(i)) is None else token_bytes(token) for i in range(size)
        ]
        vocab = cls(pieces, frozenset(i for i, token in added.items() if token.special))
        return vocab if vocab._agrees_with(hf, list(added)) else None

    def _agrees_with(self, hf: HfTokenizer, added: list[int]) -> bool:
        """Whether the table decodes as ``hf`` does: every ``added`` token and a sample of the
        other ids alone, and random sequences with and without skipping special tokens.

        Samples weight multi-byte pieces and added tokens, where a table could go wrong; the
        same seed every time, so a failure reproduces. (Every id alone would double the
        cost: ~0.12 s more for 128k ids.)
        """
        rng = random.Random(0)
        rare = [i for i, piece in enumerate(self.with_special) if not piece.isascii()] + added
        pool = rare or list(range(self.size))

        def pick() -> int:
            return rng.choice(pool) if rng.random() < 0.5 else rng.randrange(self.size)

        singles = [[i] for i in added] + [[pick()] for _ in range(_CHECK_SINGLES)]
        sequences = [[pick() for _ in range(_CHECK_LENGTH)] for _ in range(_CHECK_SEQUENCES)]
        checks = singles + sequences
        for skip in (False, True):
            expected = hf.decode_batch(checks, skip_special_tokens=skip)
            if [self.decode(ids, skip) for ids in checks] != expected:
                return False
        return True

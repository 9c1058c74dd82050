"""The byte table of byte-level vocabularies (smgd/text/bytelevel.py) and the detokenizer's
path through it: the same pieces as DecodeStream, and no table where it would be wrong."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models, pre_tokenizers

from smgd.assets import TINY_MODEL_DIR
from smgd.config import load_config
from smgd.gateway import Gateway
from smgd.router import Router
from smgd.text import bytelevel
from smgd.text.bytelevel import ByteLevelVocab, token_bytes
from smgd.text.detok import IncrementalDetokenizer
from smgd.text.tokenizer import Tokenizer, load_tokenizer

REPO_CONFIG = Path(__file__).resolve().parents[1] / "smgd.toml"


@functools.cache
def tok() -> Tokenizer:
    return load_tokenizer(TINY_MODEL_DIR)


def wrap(hf: HfTokenizer) -> Tokenizer:
    return Tokenizer(hf, tokenizer_config={}, generation_config={}, model_config={}, chat=None)


def metaspace_tokenizer() -> HfTokenizer:
    """A SentencePiece-style vocabulary: its decoder is Metaspace's, not byte-level."""
    vocab = {"[UNK]": 0, "▁hello": 1, "▁world": 2, "!": 3}
    hf = HfTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    return hf


# Any id of the tiny vocabulary (its special tokens and its byte tokens, which make split and
# invalid UTF-8) and a few beyond it; batches of one to four ids.
IDS = st.lists(st.integers(0, 1030), max_size=40)
SIZES = st.lists(st.integers(1, 4), min_size=1, max_size=40)


def batches(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, i = [], 0
    for size in sizes:
        out.append(ids[i : i + size])
        i += size
    if i < len(ids):
        out.append(ids[i:])
    return [batch for batch in out if batch]


@settings(max_examples=300, deadline=None)
@given(
    ids=IDS,
    sizes=SIZES,
    skip=st.booleans(),
    keep_held=st.booleans(),
    prompt=st.lists(st.integers(0, 1023), max_size=30),
)
# Found by this test: "!" then a stray byte and specials in one push; the DecodeStream path's
# flush took the specials' empty text for a complete end and dropped the "!".
@example(ids=[0, 6, 100, 0, 0, 0, 0, 0, 0], sizes=[1], skip=True, keep_held=False, prompt=[])
def test_the_table_gives_decode_streams_pieces_step_by_step(
    ids: list[int], sizes: list[int], skip: bool, keep_held: bool, prompt: list[int]
) -> None:
    """Not only the same text in the end: the same text from every push, so a stream's events
    are what they were with DecodeStream (which is primed with the prompt; the table is not)."""
    pieces = []
    for table in (True, False):
        d = IncrementalDetokenizer(
            tok(),
            use_byte_table=table,
            skip_special_tokens=skip,
            keep_held=keep_held,
            prompt_ids=prompt,
        )
        assert (d._table is not None) == table
        pieces.append([*map(d.push, batches(ids, sizes)), d.flush()])
    assert pieces[0] == pieces[1]


def test_the_tiny_vocabulary_is_byte_level_and_its_table_is_built_once() -> None:
    vocab = tok().byte_level
    assert vocab is not None
    assert vocab is tok().byte_level  # cached on the tokenizer
    assert vocab.size == tok().vocab_size
    # Its special tokens are empty in the table that skips them, and only there.
    for special in tok().special_ids:
        assert vocab.table(True)[special] == b""
        assert vocab.table(False)[special] == tok().decode([special], False).encode()


def test_ids_outside_the_vocabulary_decode_to_nothing_as_in_the_tokenizer() -> None:
    size = tok().vocab_size
    known = tok().encode("ok 🦀", add_special_tokens=False)
    strays = [size, size + 100, -1]  # -1: never read from the table's end
    assert tok().decode([*known, size, size + 100]) == "ok 🦀"  # the tokenizer drops them
    d = IncrementalDetokenizer(tok())
    pieces = [d.push([i]) for i in known]
    assert [d.push([i]) for i in strays] == ["", "", ""]
    assert "".join(pieces) + d.flush() == "ok 🦀"
    # Within a batch, and between the bytes of one character.
    whole = IncrementalDetokenizer(tok())
    assert whole.push([*known[:-1], *strays, known[-1]]) + whole.flush() == "ok 🦀"


def test_a_vocabulary_whose_decoder_is_not_byte_level_has_no_table() -> None:
    hf = metaspace_tokenizer()
    assert ByteLevelVocab.of(hf) is None
    d = IncrementalDetokenizer(wrap(hf))
    assert d._table is None
    assert d._stream is not None  # DecodeStream, as before the table existed
    assert d.push([1]) + d.push([2, 3]) + d.flush() == hf.decode([1, 2, 3])


def test_a_byte_level_decoder_inside_a_sequence_has_no_table() -> None:
    hf = HfTokenizer.from_str(tok().hf.to_str())
    hf.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    assert ByteLevelVocab.of(hf) is None


def test_a_table_that_disagrees_with_the_tokenizers_decode_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check against the tokenizer's own decode can fail: a table that is wrong for the
    multi-byte pieces alone (a fraction of the vocabulary) is not used."""
    hf = HfTokenizer.from_str(tok().hf.to_str())
    assert ByteLevelVocab.of(hf) is not None

    def wrong(token: str) -> bytes:
        piece = token_bytes(token)
        return piece if piece.isascii() else piece[:-1]

    monkeypatch.setattr(bytelevel, "token_bytes", wrong)
    assert ByteLevelVocab.of(hf) is None


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        ("hello", b"hello"),
        ("Ġworld", b" world"),  # GPT-2's stand-in for a space
        ("Ċ", b"\n"),
        ("âĤ¬", "€".encode()),  # three stand-ins, one character
        ("ð", b"\xf0"),  # the first byte of a 4-byte character alone
        ("<|im_end|>", b"<|im_end|>"),
        ("日本", "日本".encode()),  # outside the alphabet: the token's own UTF-8
        ("a b", b"a b"),  # a plain space is not in the alphabet either
    ],
)
def test_token_bytes_maps_the_alphabet_and_keeps_other_tokens_as_utf8(
    token: str, expected: bytes
) -> None:
    assert token_bytes(token) == expected


def test_the_table_path_costs_no_decoder_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pushing and flushing on the table's path never reaches the tokenizer."""
    calls: list[Any] = []
    d = IncrementalDetokenizer(tok(), keep_held=False)
    monkeypatch.setattr(d, "_hf", _Refuse(calls))
    ids = tok().encode("Café 🦀 ok", add_special_tokens=False)
    text = "".join(d.push([i]) for i in ids) + d.flush()
    assert text == tok().decode(ids)
    assert calls == []


def test_an_id_met_before_comes_from_the_shared_cache_with_the_same_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fresh = load_tokenizer(TINY_MODEL_DIR)  # its own vocabulary, so its own empty cache
    assert fresh.byte_level is not None
    ids = fresh.encode("Café 🦀 ok, café 🦀 ok", add_special_tokens=False)
    cold = IncrementalDetokenizer(fresh)
    first = [cold.push([i]) for i in ids]
    whole = fresh.byte_level.whole_texts(True)
    table = fresh.byte_level.table(True)
    # Cached: ids whose bytes alone are whole characters, with that text; never a byte of 🦀.
    assert whole
    assert all(text == table[i].decode() and text[-1] != "\ufffd" for i, text in whole.items())
    assert not any(table[i] in "🦀".encode() for i in whole)
    assert fresh.byte_level.whole_texts(False) == {}  # the other table's cache is its own
    decoded: list[int] = []
    warm = IncrementalDetokenizer(fresh)
    first_time = warm._first_time

    def recording(token_id: int, piece: bytes) -> str:
        decoded.append(token_id)
        return first_time(token_id, piece)

    monkeypatch.setattr(warm, "_first_time", recording)
    second = [warm.push([i]) for i in ids]
    assert second == first  # the same piece from every push
    assert "".join(second) + warm.flush() == fresh.decode(ids)
    assert decoded and not set(decoded) & set(whole)  # only ids the cache cannot hold


class _Refuse:
    def __init__(self, calls: list[Any]) -> None:
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        self._calls.append(name)
        raise AssertionError(f"the tokenizer's {name} was called")


def test_the_gateway_builds_the_table_when_it_loads_a_tokenizer() -> None:
    """At start-up (and reload), not on the first request that detokenizes."""
    config = load_config(REPO_CONFIG)
    gateway = Gateway(config=config, router=Router(config.routing))
    texts = gateway.stage_texts(config)
    assert texts
    for text in texts.values():
        assert "byte_level" in vars(text.tokenizer)  # cached_property: built already
        assert text.tokenizer.byte_level is not None  # the mock's tiny vocabulary

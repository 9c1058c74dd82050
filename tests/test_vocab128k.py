"""The 128k-token vocabulary built offline (smgd/assets/vocab128k.py) and the bench's use of it.

The fast tests train a small vocabulary of the same shape (same pre-tokenizer, generator and
special-token layout, ~2k merged tokens) in a second or two; the slow one builds the real
128k one (~20-40 s on this machine) through the cache, as ``smgd bench --vocab 128k`` does.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest

from smgd.assets import vocab128k
from smgd.bench.workload import build_prompt
from smgd.text.detok import IncrementalDetokenizer
from smgd.text.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from pathlib import Path

    from tokenizers import Tokenizer

SMALL_MERGED = 2000


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vocab-small")
    tok = vocab128k.build_tokenizer(merged_tokens=SMALL_MERGED, synthetic=3000, scale=2000)
    vocab128k.write_model_dir(out, tok)
    return out


def _split_tokens(tok: Tokenizer, ids: list[int]) -> int:
    """How many of ``ids`` stand for bytes that are not whole characters."""
    return sum(1 for i in ids if "\ufffd" in tok.decode([i]))


def _check_vocabulary(model_dir: Path, merged: int) -> None:
    tok = load_tokenizer(model_dir)
    assert tok.hf.get_vocab_size() == merged + vocab128k.SPECIAL_COUNT
    # Llama-3's layout: the special tokens after the merged ones, at its offsets.
    assert tok.token_to_id(vocab128k.BOS) == merged
    assert tok.token_to_id(vocab128k.EOT) == merged + 9
    assert tok.eos_token_ids == (merged + 1, merged + 9)
    assert len(tok.special_ids) == vocab128k.SPECIAL_COUNT
    text = vocab128k.SAMPLE_TEXT
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # exact round trip
    assert tok.encode(text)[0] == merged  # BOS added, once
    assert _split_tokens(tok.hf, ids) > 10  # characters split across tokens
    # smgd's streaming detokenizer, one id at a time, against tokenizers' own decode: never
    # ahead of it, level with it whenever its text ends on a whole character, and the same
    # text in the end (the byte table, DecodeStream and the fallback path).
    assert tok.byte_level is not None  # a byte-level vocabulary: the table applies
    for table, decode_stream in ((True, True), (False, True), (False, False)):
        detok = IncrementalDetokenizer(tok, use_byte_table=table, use_decode_stream=decode_stream)
        streamed = ""
        for k, token_id in enumerate(ids, 1):
            streamed += detok.push([token_id])
            whole = tok.decode(ids[:k])
            assert whole.startswith(streamed), (table, decode_stream, k)
            if not whole.endswith("\ufffd"):
                assert streamed == whole, (table, decode_stream, k)
        assert streamed + detok.flush() == text
    # The table's pieces are DecodeStream's, for random ids over the whole vocabulary in
    # random batches (split characters, stray bytes, special tokens), either flush.
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        cuts = sorted(rng.sample(range(1, len(ids) + 1), rng.randrange(1, len(ids) + 1)))
        batches = [ids[a:b] for a, b in zip([0, *cuts], cuts, strict=False)]
        skip, keep_held = rng.random() < 0.5, rng.random() < 0.5
        pieces = []
        for table in (True, False):
            detok = IncrementalDetokenizer(
                tok, use_byte_table=table, skip_special_tokens=skip, keep_held=keep_held
            )
            pieces.append([*map(detok.push, batches), detok.flush()])
        assert pieces[0] == pieces[1], (ids, batches, skip, keep_held)


def test_small_build_round_trips_and_streams_like_tokenizers_decode(small_dir: Path) -> None:
    _check_vocabulary(small_dir, SMALL_MERGED)


def test_build_is_deterministic(small_dir: Path) -> None:
    again = vocab128k.build_tokenizer(merged_tokens=SMALL_MERGED, synthetic=3000, scale=2000)
    assert load_tokenizer(small_dir).hf.to_str() == again.to_str()


def test_bench_prompt_with_split_characters_streams_known_text(small_dir: Path) -> None:
    text = vocab128k.SAMPLE_TEXT
    prompt = build_prompt(small_dir, 64, 150, text)
    tok = load_tokenizer(small_dir)
    assert len(prompt.ids) == 64
    assert _split_tokens(tok.hf, prompt.ids) > 0
    assert prompt.expected_text == tok.decode(prompt.expected_ids)
    assert "\ufffd" not in prompt.expected_text  # the echo never ends inside a character
    # A token that ends inside a character adds no text; the one completing it adds it all.
    steps = [b - a for a, b in zip([0, *prompt.prefix_lens], prompt.prefix_lens, strict=False)]
    assert 0 in steps
    assert prompt.prefix_lens[-1] == len(prompt.expected_text)
    # The same per-token text as smgd's own streaming detokenizer gives.
    detok = IncrementalDetokenizer(tok)
    streamed = [detok.push([token_id]) for token_id in prompt.expected_ids]
    assert steps == [len(piece) for piece in streamed]
    assert "".join(streamed) == prompt.expected_text


@pytest.mark.slow
def test_full_build_has_128k_tokens_and_streams_like_tokenizers_decode(tmp_path: Path) -> None:
    model_dir = vocab128k.model_dir(tmp_path)
    assert model_dir.parent == tmp_path
    assert vocab128k.model_dir(tmp_path) == model_dir  # cached: found, not rebuilt
    _check_vocabulary(model_dir, vocab128k.MERGED_TOKENS)
    assert load_tokenizer(model_dir).hf.get_vocab_size() >= 128_000
    prompt = build_prompt(model_dir, 64, 128, vocab128k.SAMPLE_TEXT)
    assert 0 in [b - a for a, b in zip(prompt.prefix_lens, prompt.prefix_lens[1:], strict=False)]


def test_bench_vocab_flag_puts_every_target_on_the_built_vocabulary(
    small_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from smgd.assets import TINY_MODEL_DIR
    from smgd.bench.main import add_bench_args, workload_from_args
    from smgd.bench.targets import smgd_config

    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    tiny, _ = workload_from_args(parser.parse_args([]))
    assert (tiny.vocab, tiny.model_dir()) == ("tiny", None)
    assert f'model_dir = "{TINY_MODEL_DIR}"' in smgd_config(tiny, port=1, run_dir="/r")
    monkeypatch.setattr(vocab128k, "model_dir", lambda: small_dir)
    big, _ = workload_from_args(parser.parse_args(["--vocab", "128k"]))
    assert (big.vocab, big.model_dir(), big.prompt_text()) == (
        "128k",
        small_dir,
        vocab128k.SAMPLE_TEXT,
    )
    assert f'model_dir = "{small_dir}"' in smgd_config(big, port=1, run_dir="/r")
    with pytest.raises(SystemExit):
        parser.parse_args(["--vocab", "32k"])

"""A real-sized vocabulary, built offline: a 128k-token byte-level BPE model dir (Llama-3 shape).

The packaged tiny model (:mod:`smgd.assets.make_tiny_model`) has 1k tokens; real models have
128k-152k, with long tokens, whole CJK words, and tokens that end inside a UTF-8 character.
This module trains one like that in ~20 s without any download: Llama-3's pre-tokenizer
(its split regex, then byte-level), 128,000 merged tokens and 256 special tokens after them
(``<|begin_of_text|>`` = 128000, ``<|eot_id|>`` = 128009, as Llama-3 numbers them).

The training text is generated here from a fixed seed: Zipf-distributed words of English
(:data:`SAMPLE_TEXT`'s own Latin words first, so real text tokenizes into whole words), synthetic
words built from syllables (the long tail that fills the vocabulary), accented Latin words,
CJK and Hangul words, emoji, numbers, code punctuation and indentation runs. Training runs
single-threaded in a child process (``RAYON_NUM_THREADS=1``: merge order must not depend on
thread scheduling), so the same generator version and ``tokenizers`` version give the same
files byte for byte.

:func:`model_dir` returns the cached directory (under ``$XDG_CACHE_HOME/smgd``, else
``~/.cache/smgd``), building it on first use::

    python -m smgd.assets.vocab128k             # build (or find) the cached dir, print its path
    python -m smgd.assets.vocab128k --out DIR   # build into DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

# Bump when anything below changes what is built: it names the cache directory.
GENERATOR_VERSION = 1
SEED = 20261204
# Llama-3's layout: 128,000 merged tokens, then 256 special ones.
MERGED_TOKENS = 128_000
SPECIAL_COUNT = 256
VOCAB_SIZE = MERGED_TOKENS + SPECIAL_COUNT
# Llama-3's pre-tokenizer split: contractions, letter runs with one leading non-letter,
# numbers of up to 3 digits, punctuation runs, newlines, whitespace runs.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
MAX_POSITION_EMBEDDINGS = 8192
# Synthetic word types in the long tail: ~115k distinct after duplicates, enough pairs for
# 128k merges. Each appears about ZIPF_SCALE / (rank + 10) times (at least twice, the
# trainer's min_frequency): a 2-3 M word corpus that trains in ~20 s on one core.
SYNTHETIC_WORDS = 150_000
ZIPF_SCALE = 200_000
MIN_FREQUENCY = 2

# Real text for prompts (the benchmark's --vocab 128k streams it back): prose, code, accented
# Latin, CJK, Hangul, emoji, mixed in every line so that any 64-token window has them all.
# Its rare characters (the emoji, 龘靐齉, 𠀋, ꙮ...) are not in the training text, so they come
# out as byte tokens split inside a character.
SAMPLE_TEXT = """\
A router sits between clients and engines. 東京の天気は晴れです。 Le café ouvre à six heures. \
🦜 Rare: 龘靐齉 𠀋 ∮ ⅋ ꙮ. 서울은 한국의 수도입니다. def stream(request, *, timeout_s=30.0): \
Über die Brücke fährt ein Zug nach München, und die Straße ist naß. 我们一起学习语言模型。 🪐🧬
Every request is tokenized, queued, scheduled into a batch and streamed back one token at a \
time. 明日は雨が降るでしょう。 El niño pidió una canción. 안녕하세요, 만나서 반갑습니다. \
    for token_id in engine.generate(prompt_ids, max_tokens=128): yield detok.push([token_id])
When a host drains, it finishes what it has started and refuses new work; les élèves révisent \
leurs leçons. 今天天气很好。 The balancer sends new work to the other host. 🦜🪐 龘𠀋 ꙮ⅋
"""

_ENGLISH_TEXT = """\
the of and to in is that it for as was with be by on not he this are or his from at which \
but have an they you were her all she there would their we him been has when who will more \
no if out so said what up its about into than them can only other new some could time these \
two may then do first any my now such like our over man me even most made after also did \
many before must through back years where much your way well down should because each just \
those people how too little state good very make world still own see men work long get here \
between both life being under never day same another know while last might us great old year \
off come since against go came right used take three model token engine request stream text \
server client host batch queue scheduler router balancer detokenizer prompt reply drain \
python function return import class yield def self none true false value error result"""
_ENGLISH = _ENGLISH_TEXT.split()

_ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t",
           "v", "w", "z", "ch", "sh", "th", "st", "tr", "pl", "gr", "br", "qu")  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea", "io", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "x")
_ACCENTED = "éèêàâçôûüöäßñíóúãõøåæœ"
_CODE = ("(", ")", "):", "()", "[]", "{}", " =", " ==", " !=", " ->", ".", ",", ":", '"""',
         " #", " +=", "__", "_", "'", '"', " {", " }", ";", " */", " /*", "://")  # fmt: skip
# CJK ideographs, kana and Hangul syllables (whole blocks, the first of each block picked
# far more often): multi-byte characters the trainer merges into whole characters and words
# where they are frequent, leaving the rare ones as partial-byte tokens.
_CJK = [chr(c) for c in range(0x4E00, 0x9FA6)]
_KANA = [chr(c) for c in range(0x3041, 0x3097)]
_HANGUL = [chr(c) for c in range(0xAC00, 0xD7A4)]
_EMOJI = [chr(c) for c in range(0x1F600, 0x1F650)]


def special_tokens() -> list[str]:
    """Llama-3's 256 special tokens, in id order after the merged ones: five named ones at
    their Llama-3 offsets, ``<|reserved_special_token_N|>`` in the other slots."""
    named = {0: BOS, 1: EOS, 6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: EOT}
    out: list[str] = []
    reserved = 0
    for offset in range(SPECIAL_COUNT):
        if offset in named:
            out.append(named[offset])
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return out


def _pick(rng: random.Random, items: Sequence[str]) -> str:
    # random() only: its sequence is stable across Python versions (randrange's is not promised).
    return items[int(rng.random() * len(items))]


def _synthetic_word(rng: random.Random) -> str:
    syllables = 1 + int(rng.random() * 4)
    return "".join(
        _pick(rng, _ONSETS) + _pick(rng, _VOWELS) + _pick(rng, _CODAS) for _ in range(syllables)
    )


_RARE = set("龘靐齉𠀋ꙮ⅋∮")


def _common_cjk(char: str) -> bool:
    return 0x3000 <= ord(char) < 0x10000 and char not in _RARE


def _word_types(rng: random.Random, synthetic: int) -> list[str]:
    """Every word type, most frequent first (its rank gives its Zipf count)."""
    # The sample's Latin-script words (a real vocabulary knows them whole); its CJK, Hangul
    # and rarer characters are left to the synthetic words, as a real text's would be.
    sample_words = [
        w for w in SAMPLE_TEXT.replace("\n", " ").split(" ") if w and max(map(ord, w)) < 0x250
    ]
    # Its CJK and Hangul text in two-character pieces, as a real vocabulary has the common
    # characters and pairs (not the rare ones: they must stay split into bytes).
    cjk = "".join(c if _common_cjk(c) else " " for c in SAMPLE_TEXT)
    pairs = [run[i : i + 2] for run in cjk.split() for i in range(0, len(run), 2)]
    types: list[str] = [*_ENGLISH, *sample_words, *pairs]
    for i in range(synthetic):
        word = _synthetic_word(rng)
        kind = i % 10
        if kind == 7:  # accented Latin
            cut = int(rng.random() * (len(word) + 1))
            word = word[:cut] + _pick(rng, _ACCENTED) + word[cut:]
        elif kind == 8:  # a CJK, kana or Hangul word of 1-3 characters
            pool = _pick(rng, ("cjk", "kana", "hangul"))
            chars = {"cjk": _CJK, "kana": _KANA, "hangul": _HANGUL}[pool]
            length = 1 + int(rng.random() * 3)
            word = "".join(chars[int(rng.random() ** 3 * len(chars))] for _ in range(length))
        elif kind == 9:  # code: an identifier with punctuation
            word = word + _pick(rng, _CODE) + _synthetic_word(rng)
        types.append(word)
    return list(dict.fromkeys(types))


def corpus(synthetic: int = SYNTHETIC_WORDS, scale: int = ZIPF_SCALE) -> Iterator[str]:
    """The training text in chunks, from :data:`SEED`: the same on every machine."""
    rng = random.Random(SEED)
    types = _word_types(rng, synthetic)
    chunk: list[str] = []
    for rank, word in enumerate(types):
        count = max(MIN_FREQUENCY, scale // (rank + 10))
        variants = (word, word.capitalize()) if rank % 3 == 0 else (word,)
        for variant in variants:
            chunk.append((" " + variant) * count)
        if rank % 8 == 0:  # numbers, emoji, indentation and line breaks, spread through
            chunk.append(f" {int(rng.random() * 100000)}")
            chunk.append(" " + _pick(rng, _EMOJI) * (1 + int(rng.random() * 3)))
            chunk.append("\n" + " " * (4 * int(rng.random() * 5)) + word)
        if len(chunk) >= 1000:
            yield "".join(chunk)
            chunk = []
    yield "".join(chunk)


def build_tokenizer(
    merged_tokens: int = MERGED_TOKENS, synthetic: int = SYNTHETIC_WORDS, scale: int = ZIPF_SCALE
) -> Tokenizer:
    """Train the BPE (``merged_tokens`` tokens, the 256 byte tokens included) and append the
    special tokens. Smaller arguments give a small vocabulary of the same shape (the tests)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=merged_tokens,
        min_frequency=MIN_FREQUENCY,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(synthetic, scale), trainer=trainer)
    tok.add_special_tokens(special_tokens())
    return tok


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n"


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)


def write_model_dir(out: Path, tok: Tokenizer) -> None:
    """A Hugging Face style model dir without weights, as smgd and vLLM's front end load it."""
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    specials = special_tokens()
    first = tok.token_to_id(specials[0])
    assert first is not None
    ids = {name: first + i for i, name in enumerate(specials)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(_dump(json.loads(tok.to_str())), encoding="utf-8")
    added = {
        str(ids[name]): {"content": name, "lstrip": False, "normalized": False,
                         "rstrip": False, "single_word": False, "special": True}
        for name in specials
    }  # fmt: skip
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOT,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(_dump(tokenizer_config), encoding="utf-8")
    generation_config = {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids[EOT]]}
    (out / "generation_config.json").write_text(_dump(generation_config), encoding="utf-8")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS], ids[EOT]],
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": vocab_size,
    }
    (out / "config.json").write_text(_dump(config), encoding="utf-8")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "smgd"


def model_dir(root: Path | None = None) -> Path:
    """The cached 128k model dir, built first if missing (~20 s, one core, ~1 GB RSS)."""
    # The tokenizers version is in the key too: another trainer may order equal-count merges
    # differently, and a benchmark must not compare two vocabularies under one name.
    name = f"vocab128k-v{GENERATOR_VERSION}-tokenizers{tokenizers.__version__}"
    target = (root or cache_root()) / name
    if (target / "config.json").exists():  # written last: its presence means complete
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as tmp:
        build = Path(tmp) / "out"
        subprocess.run(
            [sys.executable, "-m", "smgd.assets.vocab128k", "--out", str(build)],
            env={**os.environ, "RAYON_NUM_THREADS": "1"},
            check=True,
        )
        if not (target / "config.json").exists():  # a concurrent build may have won
            shutil.rmtree(target, ignore_errors=True)
            build.rename(target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="build into this dir (default: the cache)")
    args = parser.parse_args()
    if args.out is None:
        print(model_dir())
        return
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    write_model_dir(args.out, build_tokenizer())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

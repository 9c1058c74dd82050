"""Write a tiny random Llama (float32) and a locally trained tokenizer into a directory.

Run with the SGLang venv's python (it needs torch and transformers)::

    python tests/real_engines/make_tiny_llama.py OUT_DIR

Nothing is downloaded: the weights are random with a fixed seed and the byte-level BPE
tokenizer is trained on a small built-in corpus, so the output is the same on every machine
(about 1 MB). The model is only good for exercising a real engine's wire, not for text.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

SEED = 0  # fixed so every machine gets the same weights and hence the same greedy tokens
VOCAB = 1024  # >= the tokenizer's vocabulary and a multiple of 16 (tidy for kernels)
BPE_VOCAB = 1000  # the tokenizer trains up to this many entries; must stay <= VOCAB
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3: unk, bos=1, eos=2, pad=3

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world, this is a tiny tokenizer for testing smgd against a real engine.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "User: what is the capital of France? Assistant: Paris.",
] * 50


def build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    transformers = importlib.import_module("transformers")  # only in the engine's venv

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.save_pretrained(str(out))
    return len(fast)


def build_model(out: Path) -> None:
    torch = importlib.import_module("torch")  # torch and transformers: engine venv only
    transformers = importlib.import_module("transformers")

    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,  # the engine's context length; tests stay far below it
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    transformers.LlamaForCausalLM(config).save_pretrained(str(out), safe_serialization=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    if vocab > VOCAB:
        raise SystemExit(f"tokenizer vocabulary {vocab} exceeds the model's {VOCAB}")
    build_model(out)
    print(f"wrote {out}: tokenizer vocab {vocab}, model vocab {VOCAB}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""Build a tiny, randomly initialised Llama and a locally trained tokenizer for vLLM on CPU.

Runs with the vLLM venv's python (it needs torch, transformers and tokenizers); smgd itself
never imports it. Nothing is downloaded: the tokenizer is a byte-level BPE trained on the
interpreter's own stdlib sources, so the result depends only on the Python version and the
fixed seed.

    python make_tiny_llama_vllm.py OUT_DIR

The model is useless as a language model and exists so a real vLLM engine core can run in
seconds on a 2-core CPU box. ``head_dim`` is 32 because vLLM's CPU attention kernels only
support head sizes {32, 64, 80, ...}; the natural 64/4 = 16 fails at the first forward pass.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import sysconfig
from typing import Any

VOCAB = 2048  # small enough to train in seconds, big enough for a plausible BPE
SEED = 1234
CORPUS_FILES = 400  # first N stdlib modules, sorted: deterministic and a few MB of text
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' }}\n{{ m['content'] }}{{ '<|end|>' }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)


def _train_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))[:CORPUS_FILES]
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def build(out: str) -> None:
    import torch  # type: ignore[import-not-found,unused-ignore]
    from transformers import (  # type: ignore[import-not-found,unused-ignore]
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    os.makedirs(out, exist_ok=True)
    torch.manual_seed(SEED)
    tok = _train_tokenizer()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=SPECIALS[4:],
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # Keep the template inline and the class portable across transformers 4.x/5.x loaders;
    # no automatic BOS/EOS (the chat template adds BOS).
    tc_path = os.path.join(out, "tokenizer_config.json")
    with open(tc_path) as f:
        tc = json.load(f)
    tc.update(
        chat_template=CHAT_TEMPLATE,
        tokenizer_class="PreTrainedTokenizerFast",
        add_bos_token=False,
        add_eos_token=False,
    )
    with open(tc_path, "w") as f:
        json.dump(tc, f, indent=2)

    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # required by vLLM's CPU attention (see module docstring)
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=tok.token_to_id("<pad>"),
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    sample = tok.encode("def hello(world):").ids
    print(f"tiny llama: vocab={tok.get_vocab_size()} params={n_params} -> {out}", file=sys.stderr)
    print(f"'def hello(world):' -> {sample}", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_tiny_llama_vllm.py OUT_DIR")
    build(sys.argv[1])

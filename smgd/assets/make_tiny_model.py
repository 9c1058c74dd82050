"""Build ``smgd/assets/tiny-model/``: a small deterministic byte-level BPE model directory.

The directory looks like a Hugging Face model dir (``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``, ``config.json``) without any weights. smgd's default config serves
the mock engine with it, and the text-pipeline tests use it, so nothing has to be downloaded.

The corpus is written here (varied English plus accents, CJK and emoji, so multi-byte UTF-8
characters end up split across tokens). Training is single-threaded and the JSON is written
with sorted, fixed formatting, so re-running the script reproduces the files byte for byte::

    python -m smgd.assets.make_tiny_model            # rewrite the shipped dir
    python -m smgd.assets.make_tiny_model --out DIR  # write elsewhere (the determinism check)
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

OUT_DIR = Path(__file__).resolve().parent / "tiny-model"

# ~1k ids: big enough that common words are single tokens, small enough that rarer
# CJK characters and emoji stay split into byte tokens (what the detokenizer tests need).
VOCAB_SIZE = 1024
# Model context; mirrors a typical small Llama config.
MAX_POSITION_EMBEDDINGS = 4096

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
IM_END_ID = SPECIAL_TOKENS.index("<|im_end|>")

# A ChatML template in the usual `{% for message in messages %}` style. It renders `tools` as
# JSON (so the tools path and the order-preserving `tojson` are exercised) and rejects unknown
# roles through `raise_exception`, as many real templates do.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|im_start|>system\\nYou may call these tools:\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A router sits between clients and engines.
Hello, world! How are you today? I am fine, thank you. What time is it in Paris?
Streaming text arrives one token at a time, and the client sees it as soon as it is ready.
The scheduler batches requests, runs a forward pass, and sends the new tokens back.
Once upon a time there was a small model that knew only a thousand tokens.
It read books about rivers, mountains, cities, music, mathematics and the weather.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 4096 3.14159 2.71828 -17 +8.
Code: def add(a, b): return a + b  # comments explain why, not what.
JSON looks like {"name": "smgd", "ok": true, "items": [1, 2, 3]}.
Punctuation: ... -- ; : ! ? ( ) [ ] { } < > / \\ | @ # $ % ^ & * _ = + ~ `.
Please summarize the following paragraph in one sentence.
The user asked a question, and the assistant answered politely and briefly.
System prompts set the behaviour; user messages ask; assistant messages reply.
Stop sequences end the output early, for example at a blank line or at "User:".
Temperature controls randomness; top_p and top_k cut the tail of the distribution.
Café, naïve, façade, jalapeño, crème brûlée, Ångström, Zürich, São Paulo, Kraków.
Voilà! Ça va très bien, merci. ¿Dónde está la estación? Ich möchte ein Stück Kuchen.
Größe, Straße, Übermut, Ærøskøbing, Ελληνικά γράμματα, русский язык, שלום, مرحبا.
日本語のテキストも少し入れます。こんにちは、世界。東京は大きな都市です。
中文文本：你好，世界。今天天气很好。我们一起学习语言模型。
한국어 문장도 있습니다. 안녕하세요, 만나서 반갑습니다.
Emoji: 🙂 😀 🚀 🌍 🎉 ❤️ 👍🏽 🇫🇷 👩‍💻 🤖 ✨ 🔥 — mixed with text 🙂 like this.
Math symbols: ∑ ∫ √ ∞ ≤ ≥ ≠ ± × ÷ π θ λ µ Ω, arrows → ← ↑ ↓, and the euro sign €.
A long time ago, in a quiet village near the sea, people told stories by the fire.
The children listened carefully and remembered every word of every story.
Rain fell softly on the roof while the kettle began to sing in the kitchen.
She opened the window, looked at the stars, and wrote a letter to her brother.
He replied the next morning with a short note and a drawing of a lighthouse.
Engines stream token ids; the router turns them into text and stop strings cut it.
Every request has an id, a prompt, sampling parameters and a maximum length.
When the client goes away, the router asks the engine to abort the request.
Errors are reported with a clear message, a type, a parameter name and a code.
The weather report said: sunny in the morning, cloudy after noon, rain at night.
Lists: apples, oranges, bananas, grapes, cherries, lemons, peaches and plums.
Days: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
Months: January, February, March, April, May, June, July, August, September.
Colours: red, green, blue, yellow, purple, orange, black, white and grey.
Questions and answers: Why is the sky blue? Because air scatters blue light more.
The library opens at nine o'clock and closes at six in the evening.
Trains leave every fifteen minutes from the central station to the airport.
"""


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return tok


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n"


def write_model_dir(out: Path) -> None:
    tok = build_tokenizer()
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    out.mkdir(parents=True, exist_ok=True)
    # Round-trip through json so the file has one stable, sorted layout.
    (out / "tokenizer.json").write_text(_dump(json.loads(tok.to_str())), encoding="utf-8")
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "pad_token": PAD,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK,
    }
    (out / "tokenizer_config.json").write_text(_dump(tokenizer_config), encoding="utf-8")
    # Two EOS ids, as chat models ship them: </s> and the end-of-turn marker.
    generation_config = {
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": [SPECIAL_TOKENS.index(EOS), IM_END_ID],
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
    }
    (out / "generation_config.json").write_text(_dump(generation_config), encoding="utf-8")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": vocab_size,
    }
    (out / "config.json").write_text(_dump(config), encoding="utf-8")


def main() -> None:
    # Belt and braces: training was byte-identical with 1 and 2 rayon threads, but one thread
    # keeps merge order independent of scheduling on any machine. Set here, not at import, so
    # importing this module (the tests do) leaves the process's thread pool alone.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    write_model_dir(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

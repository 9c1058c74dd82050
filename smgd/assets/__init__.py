"""Files shipped inside the smgd package (the tiny tokenizer-only model dir)."""

from __future__ import annotations

from pathlib import Path

# A byte-level BPE model dir without weights, built by `make_tiny_model.py`. The default
# config serves the mock engine with it; tests use it.
TINY_MODEL_DIR = Path(__file__).resolve().parent / "tiny-model"

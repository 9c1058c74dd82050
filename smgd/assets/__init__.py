"""Files shipped inside the smgd package: the tiny tokenizer-only model dir, the default config.

A config names a packaged directory as ``builtin:<name>`` (``model_dir = "builtin:tiny-model"``),
so the default config works from any directory and in any install, not only in a checkout.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
# A byte-level BPE model dir without weights, built by `make_tiny_model.py`. The default
# config serves the mock engine with it; tests use it.
TINY_MODEL_DIR = HERE / "tiny-model"
# The commented default smgd.toml: `smgd serve` runs it when there is no config file, and
# `smgd init` writes it out. The repository's own smgd.toml is the same text (a test says so).
DEFAULT_CONFIG = HERE / "smgd.toml"

BUILTIN_PREFIX = "builtin:"
# What `builtin:<name>` may name: directories shipped in this package.
BUILTIN_DIRS = {"tiny-model": TINY_MODEL_DIR}


def builtin_dir(value: str) -> Path | None:
    """The packaged directory ``builtin:<name>`` names; None if ``value`` is not one.

    Raises :class:`KeyError` for an unknown name (the caller turns it into a config error).
    """
    if not value.startswith(BUILTIN_PREFIX):
        return None
    return BUILTIN_DIRS[value[len(BUILTIN_PREFIX) :]]

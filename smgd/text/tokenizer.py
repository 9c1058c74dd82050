"""Load a model's tokenizer from a Hugging Face style model dir, without ``transformers``.

Reads ``tokenizer.json`` (through the Rust ``tokenizers`` library), ``tokenizer_config.json``
(BOS/EOS strings, ``add_bos_token``, chat template), ``generation_config.json`` (the EOS ids
the model really stops on) and ``config.json`` (context length). Pure and synchronous.

BOS handling: ``encode(text, add_special_tokens=True)`` runs the tokenizer's own post-processor
(which adds BOS for Llama-style tokenizer.json files) and then adds BOS/EOS as
``add_bos_token``/``add_eos_token`` ask, never twice: a chat template that already renders
``{{ bos_token }}`` does not end up with two BOS tokens.

Threads: ``encode`` holds the GIL for the whole call; ``encode_many`` goes through
``encode_batch``, which releases it, so big prompts should be tokenized with
``trio.to_thread.run_sync(tok.encode_many, [text])``.

Tokenizing costs CPU in proportion to the text (about a second per MB here, far more for
some texts), so a text that cannot fit the context should be refused before that:
``max_token_chars`` is the most characters of input one token can stand for, computed once
from the vocabulary and the normalizer / pre-tokenizer, or None where no such bound holds.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as HfTokenizer

from smgd.errors import ConfigError, InvalidRequest
from smgd.text.bytelevel import ByteLevelVocab
from smgd.text.chat import ChatTemplate, load_chat_template
from smgd.textfile import read_utf8

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = ["MAX_TOKEN_ID", "Tokenizer", "load_tokenizer"]

# The ids a `tokenizers` tokenizer takes at all (u32): outside them its decode and
# id_to_token raise OverflowError. An engine may still send one; it has no text.
MAX_TOKEN_ID = 2**32 - 1

# config.json keys that carry the context length, most common first (Llama/Qwen, GPT-2,
# MPT/others). Multimodal configs nest them under `text_config`.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")

# Normalizers that never make text shorter: a token's piece is then at least as long as the
# input it stands for. (Lowercasing can lengthen a character, never shorten one.)
_KEEPING_NORMALIZERS = frozenset({"Prepend", "Lowercase", "NFD", "NFKD"})
# Composing normalizers turn a base character and its combining marks into one character: at
# most 4 code points become one (the longest canonical decomposition, e.g. U+1F82 GREEK SMALL
# LETTER ALPHA WITH PSILI AND VARIA AND YPOGEGRAMMENI; UAX #15's NFD expansion factor is 4).
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
_COMPOSE_FACTOR = 4
# Pre-tokenizers that only split text or map it one character (or byte) to one character.
# Whitespace, WhitespaceSplit, BertPreTokenizer and CharDelimiterSplit drop what they split on.
_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}
)


def _read_json(path: Path, *, required: bool, config_path: str) -> dict[str, Any]:
    if not path.exists():
        if required:
            raise ConfigError(f"{path} not found", path=config_path)
        return {}
    text = read_utf8(path, key=config_path, hint="JSON files are UTF-8")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}", path=config_path) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must contain a JSON object", path=config_path)
    return data


def _token_str(value: object) -> str | None:
    """A special token in tokenizer_config: a string, or an AddedToken dict with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _int_ids(value: object) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def _text_factor(normalizer: Mapping[str, Any] | None) -> int | None:
    """How many input characters one normalized character can stand for; None: unbounded."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for step in normalizer.get("normalizers") or ():
            inner = _text_factor(step)
            if inner is None:
                return None
            factor *= inner
        return factor
    if kind in _KEEPING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return _COMPOSE_FACTOR
    if kind == "Replace":  # a fixed string replaced by one at least as long keeps the length
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content")
        if isinstance(pattern, str) and isinstance(content, str) and len(content) >= len(pattern):
            return 1
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, regex Replace: may drop text


def _keeps_text(pre_tokenizer: Mapping[str, Any] | None) -> bool:
    """Whether the pre-tokenizer hands on every character of its input."""
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(step) for step in pre_tokenizer.get("pretokenizers") or ())
    if kind in ("Split", "Punctuation") and str(pre_tokenizer.get("behavior")) == "Removed":
        return False
    return kind in _KEEPING_PRE_TOKENIZERS


def _unknowns_fuse(hf: HfTokenizer) -> bool:
    """Whether a run of characters outside the vocabulary can become one unknown token.

    BPE and Unigram with ``fuse_unk`` and no byte fallback do that (a megabyte of unknown
    characters is one token); WordPiece turns a whole word it cannot split into one; WordLevel
    maps whole words.
    """
    model = hf.model
    kind = type(model).__name__
    if kind == "BPE":
        return bool(getattr(model, "fuse_unk", False)) and not getattr(
            model, "byte_fallback", False
        )
    if kind == "Unigram":  # its options are only in its serialized form
        state = json.loads(model.__getstate__())
        return bool(state.get("fuse_unk", True)) and not state.get("byte_fallback", False)
    return True


def max_token_chars(hf: HfTokenizer) -> int | None:
    """The most characters of input text one token can stand for; None if there is no bound.

    A token's piece in the vocabulary is at least as long as the text it covers when the
    normalizer and pre-tokenizer never shorten the text: a byte-level piece has one character
    per byte, a SentencePiece piece one per character (``▁`` for a space), a byte-fallback
    piece (``<0xE4>``) is longer than its byte. Added tokens match their own content. So the
    longest piece bounds the characters per token, times the normalizer's composition factor.
    """
    normalizer = None if hf.normalizer is None else hf.normalizer.__getstate__()
    pre_tokenizer = None if hf.pre_tokenizer is None else hf.pre_tokenizer.__getstate__()
    factor = _text_factor(None if normalizer is None else json.loads(normalizer))
    if factor is None or not _keeps_text(
        None if pre_tokenizer is None else json.loads(pre_tokenizer)
    ):
        return None
    # Byte-level text has no unknown characters (every byte is in the vocabulary).
    byte_level = pre_tokenizer is not None and b'"ByteLevel"' in pre_tokenizer
    if not byte_level and _unknowns_fuse(hf):
        return None
    longest = max(map(len, hf.get_vocab(with_added_tokens=True)), default=0)
    return longest * factor if longest else None


def _context_len(config: Mapping[str, Any]) -> int | None:
    for section in (config, config.get("text_config")):
        if isinstance(section, dict):
            for key in _CONTEXT_KEYS:
                value = section.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


class Tokenizer:
    """A loaded tokenizer: encode/decode, special ids, EOS ids, context length, chat template."""

    def __init__(
        self,
        hf: HfTokenizer,
        *,
        tokenizer_config: Mapping[str, Any],
        generation_config: Mapping[str, Any],
        model_config: Mapping[str, Any],
        chat: ChatTemplate | None,
    ) -> None:
        self.hf = hf  # the raw `tokenizers.Tokenizer` (the detokenizer steps it directly)
        self.chat = chat
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.special_ids: frozenset[int] = frozenset(
            i for i, tok in hf.get_added_tokens_decoder().items() if tok.special
        )
        self.special_tokens: dict[str, str] = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            text = _token_str(tokenizer_config.get(name))
            if text is not None:
                self.special_tokens[name] = text
        self.bos_token_id = self._special_id("bos_token", generation_config, model_config)
        eos_id = self._special_id("eos_token", {}, {})
        self.eos_token_ids: tuple[int, ...] = (
            _int_ids(generation_config.get("eos_token_id"))
            or ((eos_id,) if eos_id is not None else ())
            or _int_ids(model_config.get("eos_token_id"))
        )
        self.add_bos = bool(tokenizer_config.get("add_bos_token", False))
        self.add_eos = bool(tokenizer_config.get("add_eos_token", False))
        self.max_model_len: int | None = _context_len(model_config)
        # The model's config.json ({} without one), read once here: the gateway's ModelText
        # answers from it too (vocabulary size, context length, embedding dimensions).
        self.model_config: dict[str, Any] = dict(model_config)
        # Once per tokenizer: a pass over the vocabulary (~30 ms for 150 K entries).
        self.max_token_chars: int | None = max_token_chars(hf)

    @cached_property
    def byte_level(self) -> ByteLevelVocab | None:
        """Each id's bytes, for the detokenizer, where the vocabulary is byte-level BPE's.

        Built on first use (~0.1 s for 128k ids); the gateway asks when it loads a model, so
        no request waits for it."""
        return ByteLevelVocab.of(self.hf)

    def cannot_fit(self, text: str, tokens: int) -> bool:
        """True if ``text`` is surely more than ``tokens`` tokens, decided without tokenizing."""
        per_token = self.max_token_chars
        return per_token is not None and len(text) > tokens * per_token

    def _special_id(
        self, name: str, generation_config: Mapping[str, Any], model_config: Mapping[str, Any]
    ) -> int | None:
        text = self.special_tokens.get(name)
        if text is not None:
            token_id = self.hf.token_to_id(text)
            if token_id is not None:
                return int(token_id)
        for source in (generation_config, model_config):
            ids = _int_ids(source.get(f"{name}_id"))
            if ids:
                return ids[0]
        return None

    def _fix_specials(self, ids: list[int]) -> list[int]:
        bos = self.bos_token_id
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        if self.add_eos and self.eos_token_ids and (not ids or ids[-1] not in self.eos_token_ids):
            ids.append(self.eos_token_ids[0])
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        return self._fix_specials(ids) if add_special_tokens else ids

    def encode_many(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Encode several texts in one ``encode_batch`` call (releases the GIL)."""
        encodings = self.hf.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        if not add_special_tokens:
            return [e.ids for e in encodings]
        return [self._fix_specials(e.ids) for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def decode_many(
        self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        """Decode several id lists in one ``decode_batch`` call (releases the GIL; ``decode``
        holds it: 0.5 s for 2.6 million ids)."""
        texts = self.hf.decode_batch([list(ids) for ids in batch], skip_special_tokens)
        return [str(text) for text in texts]

    def id_to_token(self, token_id: int) -> str | None:
        token = self.hf.id_to_token(token_id)
        return None if token is None else str(token)

    def token_to_id(self, token: str) -> int | None:
        token_id = self.hf.token_to_id(token)
        return None if token_id is None else int(token_id)

    def render_chat(
        self,
        messages: object,
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render a chat prompt; 400 if the model has no chat template.

        Encode the result with ``add_special_tokens=False`` when the template renders BOS
        itself (most do); ``encode`` also never doubles a BOS that is already there.
        """
        if self.chat is None:
            raise InvalidRequest(
                "this model has no chat template; use /v1/completions or configure "
                "chat_template for the engine",
                param="messages",
            )
        try:
            return self.chat.render(
                messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra
            )
        except RecursionError:
            # A template's `tojson` (or its own loops) walks nested values recursively: a body
            # nested just shallowly enough to be decoded can still be too deep to render.
            raise InvalidRequest(
                "the request's JSON is nested too deeply to render the chat template",
                param="messages",
            ) from None


def load_tokenizer(
    model_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    chat_template: str | Path | None = None,
    *,
    model_key: str = "$",
    tokenizer_key: str | None = None,
    template_key: str = "$",
) -> Tokenizer:
    """Load the tokenizer of ``model_dir`` (tokenizer files from ``tokenizer_dir`` if given).

    ``chat_template`` is an override template file. The keys are the smgd.toml keys the model
    dir, the tokenizer dir and the template came from (``$.engines[0].model_dir``...), named
    by a ``ConfigError`` about what was read from each; ``tokenizer_key`` defaults to
    ``model_key`` (the tokenizer files are the model dir's).
    """
    model = Path(model_dir)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else model
    tok_key = model_key if tokenizer_key is None else tokenizer_key
    tokenizer_file = tok_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ConfigError(
            f"no tokenizer.json in {tok_dir}",
            path=tok_key,
            hint="smgd needs a fast tokenizer (tokenizer.json); set tokenizer_dir if elsewhere",
        )
    try:
        hf = HfTokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust side raises plain Exception for every parse error
        raise ConfigError(f"cannot load {tokenizer_file}: {exc}", path=tok_key) from exc
    tokenizer_config = _read_json(
        tok_dir / "tokenizer_config.json", required=False, config_path=tok_key
    )
    generation_config = _read_json(
        model / "generation_config.json", required=False, config_path=model_key
    )
    model_config = _read_json(model / "config.json", required=False, config_path=model_key)
    special = {
        name: text
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        if (text := _token_str(tokenizer_config.get(name))) is not None
    }
    try:
        chat = load_chat_template(
            tok_dir, tokenizer_config, override=chat_template, special_tokens=special
        )
    except ConfigError as exc:
        if chat_template is not None:  # the override file's fault
            raise ConfigError(exc.message, path=template_key, hint=exc.hint) from exc
        # The tokenizer's own template (chat_template.jinja / .json, tokenizer_config.json).
        hint = exc.hint or "set chat_template to a template file to use instead"
        raise ConfigError(exc.message, path=tok_key, hint=hint) from exc
    return Tokenizer(
        hf,
        tokenizer_config=tokenizer_config,
        generation_config=generation_config,
        model_config=model_config,
        chat=chat,
    )

"""The state the HTTP layer sees: router, per-model text pipelines, drain flag, counters.

One :class:`Gateway` per daemon. The API handlers get it from the app; the daemon fills it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from smgd.config import Config, EngineConfig, resolve_path
from smgd.errors import ConfigError, ModelNotFound
from smgd.router import Router
from smgd.wire.common import EngineInfo

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    from smgd.text.tokenizer import Tokenizer


@dataclass
class ModelText:
    """Everything smgd needs to turn text into ids and back for one model."""

    tokenizer: Tokenizer
    model_dir: Path
    config_json: dict[str, Any]
    key: tuple[str, str | None, str | None] = ("", None, None)  # what it was loaded from

    @property
    def vocab_size(self) -> int:
        size = self.config_json.get("vocab_size")
        return int(size) if isinstance(size, int) else self.tokenizer.vocab_size

    @property
    def max_model_len(self) -> int | None:
        for key in ("max_position_embeddings", "max_sequence_length", "n_positions"):
            value = self.config_json.get(key)
            if isinstance(value, int) and value > 0:
                return value
        return None


@dataclass
class Gateway:
    config: Config
    router: Router
    texts: dict[str, ModelText] = field(default_factory=dict)  # by served model name
    draining: bool = False
    drain_event: trio.Event = field(default_factory=trio.Event)
    http_done: trio.Event = field(default_factory=trio.Event)  # the HTTP server has returned
    started_at: float = 0.0
    # How the daemon was started, so a reload re-reads the same file with the same overrides.
    config_path: str | None = None
    overrides: list[str] = field(default_factory=list)
    reloads_total: int = 0
    reload_failures_total: int = 0
    engine_restarts: dict[str, int] = field(default_factory=dict)  # by engine name
    # Parts that read settings at start-up register here to follow a reload: each hook gets
    # the new config, validates what it needs (raising ConfigError rejects the whole reload)
    # and returns the function that applies it.
    reload_hooks: list[Callable[[Config], Callable[[], None]]] = field(default_factory=list)
    # Set by the daemon: re-read and apply smgd.toml (returns a ReloadResult).
    reload: Callable[[], Awaitable[Any]] | None = None
    admin_binds: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: Config) -> Gateway:
        gateway = cls(config=config, router=Router(config.routing))
        gateway.texts = gateway.stage_texts(config)
        return gateway

    def prepare_reload(self, config: Config) -> list[Callable[[], None]]:
        """Run every reload hook's validation; raises ConfigError to reject the reload."""
        return [hook(config) for hook in self.reload_hooks]

    def apply_config(self, config: Config, texts: dict[str, ModelText]) -> None:
        """Switch to a validated new config (reload): text pipelines, routing, log level."""
        import logging

        self.config = config
        self.texts = texts
        self.router.routing = config.routing
        logging.getLogger().setLevel(config.logging.level.upper())

    def stage_texts(self, config: Config) -> dict[str, ModelText]:
        """Load every engine's tokenizer for ``config`` (reusing loaded ones); raise ConfigError."""
        from smgd.text.tokenizer import load_tokenizer

        texts: dict[str, ModelText] = {}
        cache: dict[tuple[str, str | None, str | None], ModelText] = {}
        for text in self.texts.values():
            cache.setdefault(text.key, text)
        for i, engine in enumerate(config.engines):
            model_dir = resolve_path(self.config, engine.model_dir)
            tok_dir = (
                resolve_path(self.config, engine.tokenizer_dir) if engine.tokenizer_dir else None
            )
            template = (
                str(resolve_path(self.config, engine.chat_template))
                if engine.chat_template
                else None
            )
            key = (str(model_dir), str(tok_dir) if tok_dir else None, template)
            if key not in cache:
                try:
                    tokenizer = load_tokenizer(model_dir, tok_dir, chat_template=template)
                except ConfigError as exc:
                    exc.path = f"$.engines[{i}].model_dir"
                    raise
                config_json = _read_json(model_dir / "config.json")
                cache[key] = ModelText(tokenizer, model_dir, config_json, key)
            for model in engine.models:
                texts[model] = cache[key]
        return texts

    def text(self, model: str) -> ModelText:
        try:
            return self.texts[model]
        except KeyError:
            raise ModelNotFound(
                f"The model `{model}` does not exist.", param="model", code="model_not_found"
            ) from None

    def fallback_info(self, engine: EngineConfig) -> EngineInfo:
        """Context length and vocab when the engine does not report them (never 0)."""
        text = self.text(engine.models[0])
        max_len = engine.max_model_len or text.max_model_len
        if engine.wire.value == "mock":
            max_len = engine.max_model_len or engine.mock.max_model_len
        if not max_len:
            raise ConfigError(
                "no context length: the model's config.json has no max_position_embeddings",
                path=f"$.engines[{self.config.engines.index(engine)}].max_model_len",
                hint="set max_model_len for this engine",
            )
        return EngineInfo(max_model_len=max_len, vocab_size=text.vocab_size)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}

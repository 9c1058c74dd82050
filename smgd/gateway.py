"""The daemon's shared state: the running config, the router, text pipelines, drain, counters.

One :class:`Gateway` per daemon (per worker, with ``server.workers``). Everyone reads it; each
field has one writer, named next to it, and nobody else assigns it:

- :mod:`smgd.supervise` (engine supervision, reload): the config, the text pipelines, the
  router's engines and routing, the restart and reload counters;
- :mod:`smgd.daemon`: the start time and the drain flag (the signal task and the admin
  listener's drain action, which the daemon hands to it);
- the HTTP layer (:mod:`smgd.api`): ``http_done`` and the reload hooks it registers.

Others act through the functions their owner hands them (the admin listener gets the
daemon's reload and drain), never by writing a field. ``tests/test_layers.py`` checks that no
module assigns a field it does not own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from smgd.config import Config, resolve_path
from smgd.errors import ModelNotFound
from smgd.router import Router
from smgd.text.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path


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


@dataclass(eq=False)
class Gateway:
    """Read-mostly state; each field is written only by the owner its section names."""

    # ---- written by smgd.supervise (apply_config on a reload; the router as engines come
    # and go; counters as engines relaunch and reloads end)
    config: Config
    router: Router  # engines: put/remove by the supervisors; routing: apply_config
    texts: dict[str, ModelText] = field(default_factory=dict)  # by served model name
    engine_restarts: dict[str, int] = field(default_factory=dict)  # by engine name
    reloads_total: int = 0
    reload_failures_total: int = 0
    # ---- written by smgd.daemon
    started_at: float = 0.0  # trio.current_time() at start (construction only)
    # Set together, once, when the drain starts (SIGTERM, SIGINT, POST /admin/drain).
    draining: bool = False
    drain_event: trio.Event = field(default_factory=trio.Event)
    # ---- written by the HTTP layer (smgd.api)
    http_done: trio.Event = field(default_factory=trio.Event)  # the HTTP server has returned
    # Parts that read settings at start-up register here to follow a reload: each hook gets
    # the new config, validates what it needs (raising ConfigError rejects the whole reload)
    # and returns the function that applies it.
    reload_hooks: list[Callable[[Config], Callable[[], None]]] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: Config, *, started_at: float = 0.0) -> Gateway:
        gateway = cls(config=config, router=Router(config.routing), started_at=started_at)
        gateway.texts = gateway.stage_texts(config)
        return gateway

    def prepare_reload(self, config: Config) -> list[Callable[[], None]]:
        """Run every reload hook's validation; raises ConfigError to reject the reload."""
        return [hook(config) for hook in self.reload_hooks]

    def apply_config(self, config: Config, texts: dict[str, ModelText]) -> None:
        """Switch to a validated new config (smgd.supervise, on a reload): text pipelines,
        routing, log level."""
        self.config = config
        self.texts = texts
        self.router.routing = config.routing
        logging.getLogger().setLevel(config.logging.level.upper())

    def stage_texts(self, config: Config) -> dict[str, ModelText]:
        """Load every engine's tokenizer for ``config`` (reusing loaded ones); raise ConfigError."""
        texts: dict[str, ModelText] = {}
        cache: dict[tuple[str, str | None, str | None], ModelText] = {}
        for text in self.texts.values():
            cache.setdefault(text.key, text)
        for i, engine in enumerate(config.engines):
            at = f"$.engines[{i}]"
            model_dir = resolve_path(config, engine.model_dir)
            tok_dir = resolve_path(config, engine.tokenizer_dir) if engine.tokenizer_dir else None
            template = (
                str(resolve_path(config, engine.chat_template)) if engine.chat_template else None
            )
            key = (str(model_dir), str(tok_dir) if tok_dir else None, template)
            if key not in cache:
                # Each error names the key its file came from (load_tokenizer knows which).
                tokenizer = load_tokenizer(
                    model_dir,
                    tok_dir,
                    chat_template=template,
                    model_key=f"{at}.model_dir",
                    tokenizer_key=f"{at}.tokenizer_dir" if tok_dir else None,
                    template_key=f"{at}.chat_template",
                )
                _ = tokenizer.byte_level  # built now rather than on the first request
                cache[key] = ModelText(tokenizer, model_dir, tokenizer.model_config, key)
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

"""Engine clients, one per wire family (:mod:`~smgd.engines.sglang`,
:mod:`~smgd.engines.vllm`, :mod:`~smgd.engines.tokenspeed`) over :mod:`~smgd.engines.base`.

:func:`smgd.supervise.build_engine_client` builds them from ``[[engines]]`` entries, with the
launch flags :func:`launch_flags` derives: :func:`grammar_args` from
``[engines.structured_output]`` (or :func:`task_args` from ``task = "embed"``) and
:func:`scheduling_args` from ``scheduling``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from smgd.config import SCHEDULING_FLAGS, is_mock

if TYPE_CHECKING:
    from smgd.config import EngineConfig


def scheduling_args(engine: EngineConfig) -> list[str]:
    """The launch flags for ``scheduling = "priority"`` ([] for "fcfs", the engines' default,
    and for what smgd does not launch)."""
    kind = "mock" if is_mock(engine) else engine.launch.kind if engine.launch else None
    if engine.scheduling != "priority" or kind is None:
        return []
    return list(SCHEDULING_FLAGS.get(kind, ()))


def grammar_args(engine: EngineConfig) -> list[str]:
    """The engine flags for ``[engines.structured_output]`` of a launched engine ([] = the
    engine's defaults). config.validate refuses the same flags in ``launch.args`` as well."""
    so = engine.structured_output
    kind = engine.launch.kind if engine.launch is not None else None
    args = [] if so.backend == "auto" else ["--grammar-backend", so.backend]
    if kind == "sglang":
        if so.disable_any_whitespace:
            args.append("--constrained-json-disable-any-whitespace")
        return args
    if kind == "tokenspeed":
        if so.disable_any_whitespace:
            args.append("--disable-any-whitespace")
        return args
    if kind == "vllm" and so.backend != "none":
        settings: dict[str, object] = {}
        if so.backend != "auto" or so.disable_any_whitespace:
            # vLLM's "auto" refuses disable_any_whitespace: name xgrammar, which auto picks
            settings["backend"] = "xgrammar" if so.backend == "auto" else so.backend
        if so.disable_any_whitespace:
            settings["disable_any_whitespace"] = True
        return ["--structured-outputs-config", json.dumps(settings)] if settings else []
    return []  # vLLM has no "none" (smgd refuses constraints itself); the mock, a command


# The flags that make each engine serve its model for embeddings (SGLang: an embedding model,
# pooled with its pooler; vLLM: the pooling runner, converting a generative model to `embed`).
TASK_FLAGS: dict[str, dict[str, list[str]]] = {
    "embed": {"sglang": ["--is-embedding"], "vllm": ["--runner", "pooling"]},
}


def task_args(engine: EngineConfig) -> list[str]:
    """The engine flags for ``task`` of a launched engine ([] for ``generate``)."""
    kind = engine.launch.kind if engine.launch is not None else None
    return list(TASK_FLAGS.get(engine.task, {}).get(kind or "", []))


def launch_flags(engine: EngineConfig) -> list[str]:
    """Every flag smgd derives from an engine's config, before ``launch.args``."""
    # No grammar backend serves an embedding model.
    first = task_args(engine) if engine.task == "embed" else grammar_args(engine)
    return [*first, *scheduling_args(engine)]

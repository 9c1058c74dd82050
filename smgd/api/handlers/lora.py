"""LoRA adapters at run time, with vLLM's routes, bodies and answers.

- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"?, "model"?}``:
  load the adapter on every engine of the base model that allows it, then serve it as the
  model ``lora_name`` (and ``<base>:<lora_name>``). 200 ``Success: LoRA adapter '<name>'
  added successfully.`` (plain text, as vLLM).
- ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: stop serving it (requests in flight
  with it finish). 200 ``Success: LoRA adapter '<name>' removed successfully.``

Only engines whose ``[engines.lora] allow_runtime_updates`` is true take part (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``). ``model`` (an smgd addition) names the base model when
several are served by such engines. Errors are OpenAI envelopes naming the parameter: 400 for
a bad or conflicting body or an engine that refused the adapter, 404 for an adapter directory
the engine cannot find or an unknown adapter to unload, 503 while an engine is not ready.
What was loaded at run time is gone when the engine is relaunched or replaced by a reload
(vLLM forgets it at a restart too); the start-up adapters come back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from smgd.api.core.prepare import Reply
from smgd.config import LORA_NAME
from smgd.errors import EngineNotReady, InvalidRequest, ModelNotFound

if TYPE_CHECKING:
    from smgd.api.core.prepare import Call
    from smgd.engines.base import EngineClient
    from smgd.gateway import Gateway

__all__ = ["load_lora_adapter", "unload_lora_adapter"]

TEXT_HEADERS = {"Content-Type": "text/plain; charset=utf-8"}


def _string(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(f"`{key}` must be a string", param=key)
    return value or ""


def _updatable(gateway: Gateway) -> list[EngineClient]:
    """The engines that load and unload adapters at run time; 400 when none does."""
    if gateway.config.server.workers > 1:
        raise InvalidRequest(
            "LoRA adapters cannot be loaded or unloaded at run time with server.workers > 1 "
            "(each worker runs its own engines); name them in [engines.lora] adapters",
            param="lora_name",
        )
    engines = [e for e in gateway.router.engines() if e.lora.runtime_updates]
    if not engines:
        raise InvalidRequest(
            "no engine allows LoRA adapters to be loaded or unloaded at run time "
            "(set [engines.lora] allow_runtime_updates = true)",
            param="lora_name",
        )
    return engines


def _targets(gateway: Gateway, engines: list[EngineClient], model: str) -> list[EngineClient]:
    """The updatable engines of base model ``model`` ("" = the only one there is)."""
    if not model:
        bases = sorted({e.models[0] for e in engines})
        if len(bases) > 1:
            raise InvalidRequest(
                f"name the base model in `model`: engines of {', '.join(bases)} take adapters",
                param="model",
            )
        model = bases[0]
    targets = [e for e in engines if model in e.models]
    if not targets:
        raise InvalidRequest(
            f"no engine of model `{model}` allows LoRA adapters to be loaded at run time",
            param="model",
        )
    return targets


async def load_lora_adapter(call: Call) -> Reply:
    """``POST /v1/load_lora_adapter``."""
    body = await call.json()
    gateway = call.ctx.gateway
    name, path = _string(body, "lora_name"), _string(body, "lora_path")
    if not name or not path:
        raise InvalidRequest(
            "Both 'lora_name' and 'lora_path' must be provided.",
            param="lora_name" if not name else "lora_path",
        )
    inplace = body.get("load_inplace", False)
    if not isinstance(inplace, bool):
        raise InvalidRequest("`load_inplace` must be a boolean", param="load_inplace")
    if not LORA_NAME.fullmatch(name):
        raise InvalidRequest(
            f"adapter name {name!r} must be 1-128 of [A-Za-z0-9_.-/] (no ':' or ',')",
            param="lora_name",
        )
    if name in gateway.router.models():
        raise InvalidRequest(
            f"The lora adapter '{name}' conflicts with a served base model.", param="lora_name"
        )
    targets = _targets(gateway, _updatable(gateway), _string(body, "model"))
    holders = [e for e in gateway.router.engines() if name in e.lora]
    if any(e.models != targets[0].models for e in holders):
        raise InvalidRequest(
            f"The lora adapter '{name}' is loaded on another base model's engines.",
            param="lora_name",
        )
    if holders and not inplace:
        raise InvalidRequest(
            f"The lora adapter '{name}' has already been loaded. If you want to load the "
            "adapter in place, set 'load_inplace' to True.",
            param="lora_name",
        )
    not_ready = [e for e in targets if not e.ready]
    if not_ready:
        raise EngineNotReady(f"engine {not_ready[0].name} is {not_ready[0].state_name}")
    if any(name in e.lora.loading for e in targets):
        raise InvalidRequest(
            f"The lora adapter '{name}' is being loaded by another request.", param="lora_name"
        )
    had = {e.name for e in holders}
    loaded: list[EngineClient] = []
    for engine in targets:
        engine.lora.loading.add(name)
    try:
        for engine in targets:
            await engine.load_adapter(name, path, load_inplace=inplace)
            loaded.append(engine)
    except BaseException:
        # Served everywhere or nowhere: an engine that took it new forgets it again.
        for engine in loaded:
            if engine.name not in had:
                engine.lora.remove(name)
        raise
    finally:
        for engine in targets:
            engine.lora.loading.discard(name)
    message = f"Success: LoRA adapter '{name}' added successfully."
    return Reply(message.encode(), TEXT_HEADERS)


async def unload_lora_adapter(call: Call) -> Reply:
    """``POST /v1/unload_lora_adapter``."""
    body = await call.json()
    gateway = call.ctx.gateway
    name = _string(body, "lora_name")
    if not name:
        raise InvalidRequest(
            "'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name"
        )
    holders = [e for e in _updatable(gateway) if name in e.lora]
    if not holders:
        raise ModelNotFound(
            f"The lora adapter '{name}' cannot be found.", param="lora_name", code="lora_not_found"
        )
    for engine in holders:
        await engine.unload_adapter(name)
    message = f"Success: LoRA adapter '{name}' removed successfully."
    return Reply(message.encode(), TEXT_HEADERS)

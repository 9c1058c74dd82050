"""Engine clients, one per wire family, built from an ``[[engines]]`` entry."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from smgd.config import EngineConfig, WireFamily, engine_ipc_dir
from smgd.errors import ConfigError
from smgd.launch import launcher_script, mock_argv

if TYPE_CHECKING:
    from smgd.engines.base import EngineClient
    from smgd.gateway import Gateway


def grammar_args(engine: EngineConfig) -> list[str]:
    """The engine flags for ``[engines.structured_output]`` of a launched engine ([] = the
    engine's defaults). config.validate refuses the same flags in ``launch.args`` as well."""
    so = engine.structured_output
    kind = engine.launch.kind if engine.launch is not None else None
    named = [] if so.backend == "auto" else ["--grammar-backend", so.backend]
    if kind == "sglang":
        return named + ["--constrained-json-disable-any-whitespace"] * so.disable_any_whitespace
    if kind == "tokenspeed":
        return named + ["--disable-any-whitespace"] * so.disable_any_whitespace
    if kind == "vllm" and so.backend != "none":
        settings: dict[str, object] = {}
        if so.backend != "auto" or so.disable_any_whitespace:
            # vLLM's "auto" refuses disable_any_whitespace: name xgrammar, which auto picks
            settings["backend"] = "xgrammar" if so.backend == "auto" else so.backend
        if so.disable_any_whitespace:
            settings["disable_any_whitespace"] = True
        return ["--structured-outputs-config", json.dumps(settings)] if settings else []
    return []  # vLLM has no "none" (smgd refuses constraints itself); the mock, a command


def build_engine_client(engine: EngineConfig, gateway: Gateway) -> EngineClient:
    config = gateway.config
    ipc_dir = engine_ipc_dir(config, engine)
    fallback = gateway.fallback_info(engine)
    wire = engine.mock.wire if engine.wire is WireFamily.MOCK else engine.wire.value
    input_path = str(ipc_dir / "in.sock")
    output_path = str(ipc_dir / "out.sock")
    argv: list[str] | None = None
    env: dict[str, str] | None = None
    launch = engine.launch
    if engine.wire is WireFamily.MOCK or (launch is not None and launch.kind == "mock"):
        text = gateway.text(engine.models[0])
        extra = [
            "--step-ms",
            str(engine.mock.step_ms),
            "--max-batch",
            str(engine.mock.max_batch),
            "--context-len",
            str(fallback.max_model_len),
            "--eos-token-ids",
            ",".join(map(str, text.tokenizer.eos_token_ids)),
            "--skip-ids",
            ",".join(map(str, sorted(text.tokenizer.special_ids))),
            *(launch.args if launch else []),
        ]
        argv = mock_argv(wire, f"ipc://{input_path}", f"ipc://{output_path}", extra)
        if wire in ("vllm", "tokenspeed"):
            argv += ["--handshake", "{handshake}"]  # filled in once the client has bound it
    elif launch is not None:
        env = dict(launch.env)
        if launch.kind == "command":
            argv = list(launch.command)
        elif launch.kind == "sglang":
            python = launch.python or "python3"
            model_dir = str(gateway.text(engine.models[0]).model_dir)
            argv = [
                python,
                launcher_script("sglang_scheduler.py"),
                "--smgd-input",
                f"ipc://{input_path}",
                "--smgd-output",
                f"ipc://{output_path}",
                "--model-path",
                model_dir,
                *grammar_args(engine),
                *launch.args,
            ]
        elif launch.kind == "tokenspeed":
            from smgd.engines.tokenspeed import tokenspeed_argv

            argv = tokenspeed_argv(
                python=launch.python or "python3",
                model=str(gateway.text(engine.models[0]).model_dir),
                args=[*grammar_args(engine), *launch.args],
            )
        elif launch.kind == "vllm":
            from smgd.engines.vllm import vllm_argv

            argv = vllm_argv(
                python=launch.python or "python3",
                launcher=launcher_script("vllm_engine.py"),
                model=str(gateway.text(engine.models[0]).model_dir),
                args=[*grammar_args(engine), *launch.args],
            )
    if wire == "vllm":
        from smgd.engines.vllm import VllmEngineClient

        return VllmEngineClient(
            engine,
            fallback_info=fallback,
            input_path=input_path,
            output_path=output_path,
            handshake=engine.addresses.handshake or f"ipc://{ipc_dir / 'hs.sock'}",
            launch_argv=argv,
            launch_env=env,
            eos_token_ids=tuple(gateway.text(engine.models[0]).tokenizer.eos_token_ids),
        )
    if wire == "tokenspeed":
        from smgd.engines.tokenspeed import DEFAULT_HANDSHAKE, TokenspeedEngineClient

        # A launched engine is told where to dial (any free port); an external one dials
        # TokenSpeed's default unless the config names the address.
        handshake = engine.addresses.handshake or (
            "tcp://127.0.0.1:*" if argv is not None else DEFAULT_HANDSHAKE
        )
        return TokenspeedEngineClient(
            engine,
            fallback_info=fallback,
            input_path=input_path,
            output_path=output_path,
            handshake=handshake,
            launch_argv=argv,
            launch_env=env,
        )
    if wire == "sglang":
        from smgd.engines.sglang import SglangEngineClient

        return SglangEngineClient(
            engine,
            fallback_info=fallback,
            input_path=input_path,
            output_path=output_path,
            launch_argv=argv,
            launch_env=env,
        )
    raise ConfigError(
        f"wire {wire!r} is not supported yet",
        path=f"$.engines[{config.engines.index(engine)}].wire",
    )

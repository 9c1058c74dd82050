"""Structured output on the engine side: who may take a constrained request, the launch flags of
``[engines.structured_output]``, its config checks, and an engine's refusal of a grammar turned
into a 400 naming the request parameter (for that request only).

The refusals are fed as real wire frames (each wire's engine-side encoder) through the client's
own frame handler. The same paths on the real SGLang scheduler and vLLM engine core are in
tests/real_engines/test_structured_real.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from smgd.config import (
    EngineConfig,
    LaunchConfig,
    StructuredOutputConfig,
    WireFamily,
    has_grammar,
    load_config,
)
from smgd.engines import grammar_args
from smgd.engines.base import EngineClient
from smgd.engines.sglang import SglangEngineClient
from smgd.engines.state import EngineState
from smgd.engines.stream import RequestStream
from smgd.engines.tokenspeed import TokenspeedEngineClient
from smgd.engines.vllm import VllmEngineClient, structured_backend
from smgd.errors import ConfigError, InvalidRequest
from smgd.launchers import sglang_scheduler_script
from smgd.wire.common import (
    EngineInfo,
    Finish,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    Structured,
    StructuredKind,
    TokenDelta,
)
from smgd.wire.sglang.engine_side import OutputItem, encode_batch_output
from smgd.wire.tokenspeed.engine_side import OutputRow, encode_output
from smgd.wire.vllm.engine_side import encode_outputs
from smgd.wire.vllm.structs import EngineCoreOutput, EngineCoreOutputs

SCHEMA = Structured(kind=StructuredKind.JSON, param="response_format", spec={"type": "object"})
SGLANG_GRAMMAR_ABORT = Finish(
    reason=FinishReason.ABORT,
    message="Failed to compile json grammar: unsupported keyword",
    status_code=400,
)
VLLM_ERROR = 3  # vLLM's FinishReason.ERROR on the wire


def config(wire: WireFamily, **so: Any) -> EngineConfig:
    return EngineConfig(
        name="e0",
        wire=wire,
        models=["m"],
        model_dir=".",
        structured_output=StructuredOutputConfig(**so),
    )


def client(wire: WireFamily, **so: Any) -> EngineClient:
    """A client that is not running: ready, with the stream bookkeeping open_stream keeps."""
    kw: dict[str, Any] = {"fallback_info": None, "input_path": "/x/in", "output_path": "/x/out"}
    engine: EngineClient
    if wire is WireFamily.SGLANG:
        engine = SglangEngineClient(config(wire, **so), **kw)
    elif wire is WireFamily.VLLM:
        engine = VllmEngineClient(config(wire, **so), handshake="ipc:///x/hs", **kw)
    else:
        engine = TokenspeedEngineClient(config(wire, **so), handshake="tcp://127.0.0.1:1", **kw)
    engine.state = EngineState.READY
    engine.info = EngineInfo(max_model_len=4096, vocab_size=1024)
    return engine


def request(rid: str, structured: Structured | None = SCHEMA) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=8, structured=structured)
    return GenerateRequest(rid=rid, prompt_ids=[5, 6, 7], sampling=sampling)


def open_request(engine: EngineClient, req: GenerateRequest) -> RequestStream:
    """What open_stream registers for a request (minus the send)."""
    stream = RequestStream(req.rid, engine.name)
    engine._streams[req.rid] = stream
    if req.sampling.structured is not None:
        engine._constrained[req.rid] = req.sampling.structured.param
    return stream


def handle(engine: EngineClient, frames: list[Any]) -> None:
    """One output message decoded and delivered, as the reader task does."""
    for delta in engine._decode_frames(frames):
        engine.deliver(delta)


def finish_of(stream: RequestStream) -> Finish:
    delta = stream.receive_nowait()
    assert delta is not None
    assert delta.finish is not None
    return delta.finish


# -- who takes a constrained request ------------------------------------------------------------


@pytest.mark.parametrize(
    ("wire", "so", "launch", "grammar"),
    [
        (WireFamily.SGLANG, {}, None, True),
        (WireFamily.VLLM, {}, None, True),
        (WireFamily.TOKENSPEED, {}, None, True),
        (WireFamily.SGLANG, {"backend": "none"}, None, False),
        (WireFamily.MOCK, {}, None, False),  # the mock has no grammar backend
        (WireFamily.SGLANG, {}, "mock", False),  # nor when launched as a sglang-wire mock
        (WireFamily.MOCK, {"backend": "xgrammar"}, None, True),  # unless the config says so
    ],
)
def test_has_grammar(
    wire: WireFamily, so: dict[str, Any], launch: str | None, grammar: bool
) -> None:
    engine = config(wire, **so)
    if launch is not None:
        engine = msgspec.structs.replace(engine, launch=LaunchConfig(kind=launch))  # type: ignore[arg-type]
    assert has_grammar(engine) is grammar


def test_an_engine_without_a_grammar_refuses_before_sending() -> None:
    engine = client(WireFamily.SGLANG, backend="none")
    with pytest.raises(InvalidRequest) as info:
        engine.validate(request("r1"))
    assert info.value.param == "response_format"
    assert "engine e0 has no grammar backend" in info.value.message
    engine.validate(request("r2", structured=None))  # unconstrained requests are fine


# -- refusals from the engine -------------------------------------------------------------------


def sglang_abort(rid: str, finish: Finish) -> list[bytes]:
    return [encode_batch_output([OutputItem(rid, [], finish, 3, 0, 0)])]


def vllm_error(rid: str) -> list[bytes]:
    out = EngineCoreOutputs(outputs=[EngineCoreOutput(rid, [], finish_reason=VLLM_ERROR)])
    return encode_outputs(out)


def tokenspeed_abort(rid: str) -> list[bytes]:
    return encode_output([OutputRow(rid=rid, output_ids=[], finished_reason="abort")])


@pytest.mark.parametrize(
    ("wire", "frames", "reason"),
    [
        (WireFamily.SGLANG, lambda rid: sglang_abort(rid, SGLANG_GRAMMAR_ABORT),
         "Failed to compile json grammar: unsupported keyword"),
        (WireFamily.SGLANG, lambda rid: sglang_abort(rid, Finish(
            reason=FinishReason.ABORT, status_code=400, message="Grammar-based generation "
            "(json_schema, regex, ebnf, structural_tag) is not supported when the server is "
            "launched with --grammar-backend none")), "--grammar-backend none"),
        (WireFamily.VLLM, vllm_error, "vLLM sends no reason"),
        (WireFamily.TOKENSPEED, tokenspeed_abort, "TokenSpeed sends no reason"),
    ],
)  # fmt: skip
def test_a_refused_grammar_is_a_400_naming_the_param(
    wire: WireFamily, frames: Any, reason: str
) -> None:
    engine = client(wire)
    if isinstance(engine, VllmEngineClient):
        engine._wire_add(request("r1"))  # registers the per-request state it completes
    stream = open_request(engine, request("r1"))
    handle(engine, frames("r1"))
    finish = finish_of(stream)
    assert (finish.reason, finish.status_code, finish.param) == (
        FinishReason.ABORT,
        400,
        "response_format",
    )
    assert finish.message is not None
    assert finish.message.startswith(
        "engine e0 could not apply the structured output constraint in `response_format`: "
    )
    assert reason in finish.message
    assert not engine._constrained or "r1" not in engine._streams


@pytest.mark.parametrize(
    ("wire", "frames"),
    [
        (WireFamily.SGLANG, lambda rid: sglang_abort(rid, SGLANG_GRAMMAR_ABORT)),
        (WireFamily.VLLM, vllm_error),
        (WireFamily.TOKENSPEED, tokenspeed_abort),
    ],
)
def test_the_same_finish_of_an_unconstrained_request_is_left_alone(
    wire: WireFamily, frames: Any
) -> None:
    engine = client(wire)
    if isinstance(engine, VllmEngineClient):
        engine._wire_add(request("r1", structured=None))
    stream = open_request(engine, request("r1", structured=None))
    handle(engine, frames("r1"))
    assert finish_of(stream).param is None


def test_a_vllm_error_after_tokens_is_not_about_the_grammar() -> None:
    """vLLM fails a grammar before the first token: a later ERROR is the engine's failure."""
    engine = client(WireFamily.VLLM)
    assert isinstance(engine, VllmEngineClient)
    engine._wire_add(request("r1"))
    stream = open_request(engine, request("r1"))
    handle(engine, encode_outputs(EngineCoreOutputs(outputs=[EngineCoreOutput("r1", [5])])))
    handle(engine, vllm_error("r1"))
    delta = stream.receive_nowait()
    assert delta is not None and delta.token_ids == [5]
    assert delta.finish is not None
    assert (delta.finish.reason, delta.finish.param) == (FinishReason.ERROR, None)


def test_other_sglang_aborts_of_a_constrained_request_are_left_alone() -> None:
    engine = client(WireFamily.SGLANG)
    stream = open_request(engine, request("r1"))
    other = Finish(reason=FinishReason.ABORT, message="Input too long", status_code=400)
    handle(engine, sglang_abort("r1", other))
    assert finish_of(stream) == other


def test_a_finish_for_one_request_touches_no_other() -> None:
    engine = client(WireFamily.SGLANG)
    first, second = open_request(engine, request("r1")), open_request(engine, request("r2"))
    handle(engine, sglang_abort("r1", SGLANG_GRAMMAR_ABORT))
    assert finish_of(first).param == "response_format"
    engine.deliver(TokenDelta(rid="r2", token_ids=[9], finish=Finish(reason=FinishReason.LENGTH)))
    assert finish_of(second) == Finish(reason=FinishReason.LENGTH)


# -- what the vLLM engine core is told, and the launch flags ------------------------------------


@pytest.mark.parametrize(
    ("so", "backend"),
    [
        ({}, "auto"),
        ({"disable_any_whitespace": True}, "xgrammar"),  # launched with xgrammar named
        ({"backend": "guidance"}, "guidance"),
    ],
)
def test_vllm_structured_backend(so: dict[str, Any], backend: str) -> None:
    assert structured_backend(config(WireFamily.VLLM, **so)) == backend


def test_the_vllm_client_sends_the_configured_backend() -> None:
    engine = client(WireFamily.VLLM, backend="guidance")
    assert isinstance(engine, VllmEngineClient)
    choice = Structured(kind=StructuredKind.CHOICE, param="guided_choice", choices=("a", "b"))
    frames = engine._wire_add(request("r1", structured=choice))
    sent = msgspec.msgpack.decode(frames[1])[3]["structured_outputs"]
    assert (sent["_backend"], sent["choice"]) == ("guidance", ["a", "b"])


SO_CONFIG = "--structured-outputs-config"


def launched(kind: str, **so: Any) -> EngineConfig:
    wire = WireFamily(kind)
    engine = config(wire, **so)
    return msgspec.structs.replace(engine, launch=LaunchConfig(kind=kind))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "so", "args"),
    [
        ("sglang", {}, []),
        ("sglang", {"backend": "llguidance", "disable_any_whitespace": True},
         ["--grammar-backend", "llguidance", "--constrained-json-disable-any-whitespace"]),
        ("sglang", {"backend": "none"}, ["--grammar-backend", "none"]),
        ("vllm", {}, []),
        ("vllm", {"disable_any_whitespace": True},
         [SO_CONFIG, '{"backend": "xgrammar", "disable_any_whitespace": true}']),
        ("vllm", {"backend": "guidance"}, [SO_CONFIG, '{"backend": "guidance"}']),
        ("vllm", {"backend": "none"}, []),  # vLLM has no "none": smgd refuses constraints itself
        ("tokenspeed", {}, []),
        ("tokenspeed", {"backend": "none", "disable_any_whitespace": False},
         ["--grammar-backend", "none"]),
        ("tokenspeed", {"disable_any_whitespace": True}, ["--disable-any-whitespace"]),
    ],
)  # fmt: skip
def test_grammar_launch_flags(kind: str, so: dict[str, Any], args: list[str]) -> None:
    assert grammar_args(launched(kind, **so)) == args


@pytest.mark.parametrize(
    ("grammar_backend_args", "skips_tokenizer"),
    [
        ([], False),  # SGLang's default backend (xgrammar) needs the tokenizer
        (["--grammar-backend", "xgrammar"], False),
        (["--grammar-backend=none"], True),
        (["--grammar-backend", "none"], True),
        (["--skip-tokenizer-init"], True),  # asked for: kept (once)
    ],
)
def test_sglang_launcher_keeps_the_tokenizer_for_a_grammar_backend(
    grammar_backend_args: list[str], skips_tokenizer: bool
) -> None:
    # In a subprocess: importing the launcher ties the importing process's children to it.
    script = sglang_scheduler_script()
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import sglang_scheduler as s; "
        "print(json.dumps(s._parse(sys.argv[2:])[1]))"
    )
    argv = ["--smgd-input", "ipc:///i", "--smgd-output", "ipc:///o", "--device", "cpu"]
    done = subprocess.run(
        [sys.executable, "-c", code, str(Path(script).parent), *argv, *grammar_backend_args],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    rest = json.loads(done.stdout)
    assert rest.count("--skip-tokenizer-init") == int(skips_tokenizer)


# -- config checks ------------------------------------------------------------------------------


def load(tmp_path: Path, wire: str, structured: str, launch: str = "") -> Any:
    path = tmp_path / "smgd.toml"
    path.write_text(
        f'[[engines]]\nname = "e"\nwire = "{wire}"\nmodels = ["m"]\n'
        f'model_dir = "builtin:tiny-model"\n{launch}[engines.structured_output]\n{structured}'
    )
    return load_config(path, environ={})


@pytest.mark.parametrize(
    ("wire", "structured", "launch", "path"),
    [
        ("sglang", 'backend = "guidance"\n', "", "$.engines[0].structured_output.backend"),
        ("vllm", 'backend = "llguidance"\n', "", "$.engines[0].structured_output.backend"),
        ("tokenspeed", 'backend = "outlines"\n', "", "$.engines[0].structured_output.backend"),
        ("vllm", 'backend = "yaml"\n', "", "$.engines[0].structured_output.backend"),
        ("sglang", 'backend = "outlines"\ndisable_any_whitespace = true\n', "",
         "$.engines[0].structured_output.disable_any_whitespace"),
        ("sglang", "disable_any_whitespace = true\n",
         '[engines.launch]\nkind = "sglang"\nargs = ["--grammar-backend", "xgrammar"]\n',
         "$.engines[0].launch.args"),
        ("vllm", 'backend = "guidance"\n',
         "[engines.launch]\nkind = \"vllm\"\nargs = ['--structured-outputs-config={}']\n",
         "$.engines[0].launch.args"),
        ("sglang", "frobnicate = 1\n", "", "$.engines[0].structured_output.frobnicate"),
    ],
)  # fmt: skip
def test_bad_structured_output_config_names_the_key(
    tmp_path: Path, wire: str, structured: str, launch: str, path: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, wire, structured, launch)
    assert info.value.path == path


def test_good_structured_output_configs_load(tmp_path: Path) -> None:
    assert load(tmp_path, "vllm", 'backend = "guidance"\ndisable_any_whitespace = true\n')
    assert load(tmp_path, "mock", 'backend = "xgrammar"\n')  # the mock takes any name
    # Flags in launch.args alone are the user's business (smgd adds none of its own).
    launch = '[engines.launch]\nkind = "sglang"\nargs = ["--grammar-backend", "none"]\n'
    assert load(tmp_path, "sglang", "", launch)

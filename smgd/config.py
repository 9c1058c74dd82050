"""The one typed schema of ``smgd.toml``, with env and CLI overrides derived from it.

Precedence (what users of gateways expect): CLI flags > ``SMGD_*`` environment > file > defaults.
Every Struct forbids unknown fields, so a typo is an error with its key path, never ignored.

Overrides address keys by dotted path (``server.port``, ``engines.0.model_dir``):
- environment: ``SMGD_SERVER__PORT=9000``, ``SMGD_ENGINES__0__MODEL_DIR=/m`` (``__`` separates)
- CLI: ``--set server.port=9000``, and one flag per scalar key of the fixed sections
  (``--server-port 9000``), generated from the schema below.
Values are parsed as TOML literals (``9000``, ``true``, ``"x"``, ``[1, 2]``); anything that is
not a TOML literal is taken as a string.
"""

from __future__ import annotations

import difflib
import enum
import ipaddress
import itertools
import os
import re
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from smgd.assets import BUILTIN_DIRS, BUILTIN_PREFIX, builtin_dir
from smgd.errors import ConfigError
from smgd.ipc import SUN_PATH_MAX
from smgd.parse.registry import REASONING_PARSERS, TOOL_PARSERS
from smgd.textfile import read_utf8

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

ENV_PREFIX = "SMGD_"


class WireFamily(enum.Enum):
    SGLANG = "sglang"
    VLLM = "vllm"
    TOKENSPEED = "tokenspeed"
    MOCK = "mock"  # smgd launches its built-in mock engine (speaking `mock.wire`)


class RoutingPolicy(enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_OUTSTANDING = "least_outstanding"
    PREFIX_AFFINITY = "prefix_affinity"


# ------------------------------------------------------------------------- value ranges
# Every number in the schema has a range (tests/test_config.py walks the schema to keep it so):
# a negative size, a NaN or infinite timeout is refused at load with its key path instead of
# misbehaving at run time. Upper bounds are where a value stops being a deployment and becomes
# a typo; they also keep every float finite.

# The longest any timeout or interval may be. A day is far past any drain, start-up or probe
# interval that makes sense, and keeps trio deadlines far from float precision trouble.
DAY_S = 86400.0
# Counts of requests / tokens per engine (batch, queue, in-flight, prefix tokens): a million is
# orders of magnitude above what one engine process holds.
MAX_COUNT = 1_000_000
# Context lengths: 64 Mi tokens is above the longest context any model advertises (10 M).
MAX_CONTEXT = 1 << 26
# A request body is held in memory whole before it is parsed: beyond 1 GiB is a typo.
MAX_BODY_BYTES = 1 << 30
# More workers than this is a typo, not a deployment: each is a whole process.
MAX_WORKERS = 64

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=DAY_S)]  # 0 allowed (off / at once)
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0, le=DAY_S)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]  # 0 allowed (unlimited / none)
PositiveCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
ContextLen = Annotated[int, msgspec.Meta(ge=1, le=MAX_CONTEXT)]
Millis = Annotated[float, msgspec.Meta(ge=0, le=DAY_S * 1000)]  # durations in ms, as Seconds


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: Port = 8080
    # LLM streams run for minutes; hypercorn's own 3 s graceful timeout would cut them.
    drain_timeout_s: Seconds = 30.0
    # After SIGTERM, keep accepting connections (answering 503) this long before closing the
    # listener, so load balancers and probes see readiness fail instead of a refused connect.
    drain_settle_s: Seconds = 1.0
    # An SSE comment this often while a request waits (queue, long prefill) keeps proxies
    # from closing an idle-looking connection. 0 = off, the default: vLLM's and SGLang's own
    # servers send none, and clients written for them (SGLang's bench_serving) json-decode
    # every line. Behind a proxy with an idle timeout, set it under that timeout (e.g. 15).
    keepalive_interval_s: Seconds = 0.0
    # Largest accepted request body. 8 MiB fits a 1M-character prompt with room to spare.
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_BODY_BYTES)] = 8 * 1024 * 1024
    # Upper bound of the adaptive coalescing window: when the event loop lags, a stream waits up
    # to this long between SSE events so each carries several tokens (an event costs ~60-80 µs
    # of CPU whatever it carries: docs/design.md). 0 = one event per engine step always.
    # 150 ms keeps a loaded stream fluid (~7 tokens per event at 20 ms steps) while cutting
    # per-token CPU several-fold.
    coalesce_max_ms: Millis = 150.0
    # Bearer keys for the inference endpoints; empty = no auth. Read from this env var
    # (comma-separated) and/or this file (one key per line), never from smgd.toml itself.
    api_keys_env: str | None = None
    api_keys_file: str | None = None
    # Worker processes behind the one port (SO_REUSEPORT), each owning engines[i] with
    # i % workers == its index (smgd.workers). 1 = everything in one process. One process
    # tops out near one core; more than the machine's cores only adds contention.
    workers: Annotated[int, msgspec.Meta(ge=1, le=MAX_WORKERS)] = 1
    # CORS (smgd.api.http.cors): the browser origins ("https://ui.example", or "*") whose
    # pages may call the public API; empty = off, no CORS header is ever sent. The other three
    # shape the preflight answer; "*" allows any method or request header (Authorization
    # included: smgd echoes what the browser asks for, which a literal "*" would not cover).
    cors_allowed_origins: list[str] = msgspec.field(default_factory=list)
    cors_allowed_methods: list[str] = msgspec.field(default_factory=lambda: ["*"])
    cors_allowed_headers: list[str] = msgspec.field(default_factory=lambda: ["*"])
    cors_allow_credentials: bool = False


class AdminConfig(_Section):
    # Admin endpoints (reload, drain) listen separately, on loopback by default.
    host: str = "127.0.0.1"
    port: Port = 0  # 0: the unix socket <run_dir>/admin.sock
    token_env: str | None = None


class LoggingConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["human", "json"] = "human"
    access_log: bool = False


class RoutingConfig(_Section):
    policy: RoutingPolicy = RoutingPolicy.LEAST_OUTSTANDING
    # Per served model name; overrides `policy` for that model.
    models: dict[str, RoutingPolicy] = msgspec.field(default_factory=dict)
    # prefix_affinity: how many leading prompt tokens decide the engine. 256 tokens covers a
    # typical system prompt; longer keys only split traffic that shares the same prefix cache.
    prefix_tokens: PositiveCount = 256


class Addresses(_Section):
    """Explicit ZMQ endpoints; when absent they are derived from `ipc_dir`."""

    input: str | None = None
    output: str | None = None
    handshake: str | None = None


class LaunchConfig(_Section):
    """A child process smgd starts, wires to its sockets, and supervises."""

    kind: Literal["sglang", "vllm", "tokenspeed", "mock", "command"]
    python: str | None = None  # interpreter of the engine's venv (sglang / vllm)
    args: list[str] = msgspec.field(default_factory=list)  # passed through to the engine
    env: dict[str, str] = msgspec.field(default_factory=dict)
    command: list[str] = msgspec.field(default_factory=list)  # kind = "command" only


class MockConfig(_Section):
    wire: Literal["sglang", "vllm", "tokenspeed"] = "sglang"
    # 20 ms is a realistic decode step for a mid-size model on one GPU.
    step_ms: Millis = 20.0
    max_batch: PositiveCount = 256
    max_model_len: ContextLen = 4096
    # A TOML file of scripted replies (MockScript); prompts no reply is for are echoed.
    script: str | None = None


class MockReply(_Section):
    """One scripted reply of the mock engine."""

    text: str  # what the engine writes, tokenized with the model's tokenizer, then EOS
    when: str = ""  # for prompts whose text contains this ("" = every prompt)


class MockScript(_Section):
    """A ``[engines.mock] script`` file: the first reply whose ``when`` matches is written."""

    reply: list[MockReply] = msgspec.field(default_factory=list)


# Grammar backends by the names the engines use (--grammar-backend, vLLM's
# --structured-outputs-config backend). "auto": the engine's own default; "none": no
# structured output (smgd answers a constrained request with a 400 without sending it).
GrammarBackend = Literal[
    "auto", "xgrammar", "llguidance", "guidance", "outlines", "lm-format-enforcer", "none"
]
# Which backends each wire's engine has (the mock has none; any other name makes it accept
# constraints and ignore them, for testing the HTTP side).
GRAMMAR_BACKENDS: Mapping[str, frozenset[str]] = {
    "sglang": frozenset({"auto", "xgrammar", "llguidance", "outlines", "none"}),
    "vllm": frozenset({"auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer", "none"}),
    "tokenspeed": frozenset({"auto", "xgrammar", "none"}),
}
# The backends that can forbid free whitespace in JSON output (SGLang: xgrammar, llguidance;
# vLLM: xgrammar, guidance; TokenSpeed: xgrammar).
COMPACT_JSON_BACKENDS = frozenset({"auto", "xgrammar", "llguidance", "guidance"})
# The launch flags smgd sets from [engines.structured_output] (smgd.engines), per launch kind.
GRAMMAR_FLAGS: Mapping[str, tuple[str, ...]] = {
    "sglang": ("--grammar-backend", "--constrained-json-disable-any-whitespace"),
    "vllm": ("--structured-outputs-config",),
    "tokenspeed": ("--grammar-backend", "--disable-any-whitespace"),
}


# The launch flags smgd sets for `scheduling = "priority"`, per launch kind. SGLang's default
# runs larger values first; --schedule-low-priority-values-first gives vLLM's order, so
# `priority` means the same on every engine.
SCHEDULING_FLAGS: Mapping[str, tuple[str, ...]] = {
    "sglang": ("--enable-priority-scheduling", "--schedule-low-priority-values-first"),
    "vllm": ("--scheduling-policy", "priority"),
    "mock": ("--priority-scheduling",),
}


class StructuredOutputConfig(_Section):
    """The engine's grammar backend (constrained decoding for response_format & co.)."""

    backend: GrammarBackend = "auto"
    # JSON output without free whitespace (vLLM's disable_any_whitespace, SGLang's
    # --constrained-json-disable-any-whitespace). A grammar that allows any whitespace lets a
    # model that has not learned JSON emit whitespace until max_tokens; off by default, as in
    # the engines.
    disable_any_whitespace: bool = False


# The most adapters one batch may hold (vLLM --max-loras, SGLang --max-loras-per-batch): each
# slot reserves max_lora_rank-wide weights for every targeted layer on the device; past 256
# the reservation dwarfs any deployment's adapters.
MAX_LORAS = 256
# vLLM's largest --max-lora-rank.
MAX_LORA_RANK = 512
# What an adapter may be called: it is a model name in requests and /v1/models. No ':' (the
# `base:adapter` form splits on it) and no ',' (smgd_lora_requests_info lists names with it).
LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-/]{0,127}")
# The launch flags smgd sets from [engines.lora], per launch kind (config.validate refuses them
# in launch.args as well).
LORA_FLAGS: Mapping[str, tuple[str, ...]] = {
    "vllm": ("--enable-lora", "--max-loras", "--max-lora-rank"),
    "sglang": ("--enable-lora", "--lora-paths", "--max-loras-per-batch", "--max-lora-rank"),
}


class LoraConfig(_Section):
    """LoRA adapters on this engine's base model (docs/how-to/lora.md). Its presence launches
    the engine with LoRA enabled."""

    # Adapters served from the start: name (a model name in requests) = adapter directory
    # (adapter_config.json + weights).
    adapters: dict[str, str] = msgspec.field(default_factory=dict)
    # Adapters one batch may mix. 4 lets a few adapters share a batch without reserving much
    # device memory (vLLM's default is 1, SGLang's 8).
    max_loras: Annotated[int, msgspec.Meta(ge=1, le=MAX_LORAS)] = 4
    # The largest adapter rank the engine reserves room for; unset: the engine's default
    # (vLLM 16; SGLang the largest of the start-up adapters).
    max_lora_rank: Annotated[int, msgspec.Meta(ge=1, le=MAX_LORA_RANK)] | None = None
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter for this engine (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING): off by default, as a client could load any directory
    # on this host the engine can read.
    allow_runtime_updates: bool = False


class TimeoutsConfig(_Section):
    # SGLang needs ~30-40 s to import and load even a tiny model on this CPU; real models more.
    ready_s: PositiveSeconds = 600.0
    # A send that cannot complete in this time means the peer is gone (PUSH to a dead
    # scheduler blocks forever); 5 s is far above any healthy queueing delay.
    send_s: PositiveSeconds = 5.0
    # No frame at all for this long while requests are in flight = the engine is wedged, unless
    # it answers a health probe (where the wire has one): then it lost those requests, which
    # fail alone. A long prefill of a huge prompt on a slow GPU stays well under 60 s.
    silence_s: PositiveSeconds = 60.0
    # While idle, probe the engine this often (SGLang: a 1-token health-check generate, as
    # /health_generate does; vLLM: the utility call is_sleeping on every rank; TokenSpeed's
    # wire has no probe); 0 disables. Idle engines are otherwise never heard from.
    health_interval_s: Seconds = 30.0
    # A probe unanswered for this long = the engine is wedged. A busy scheduler answers at once.
    health_timeout_s: PositiveSeconds = 20.0
    # The longest one request may run in the engine, from when it is sent to its last token;
    # 0 = no limit. An engine that loses a request (never answers it while it answers others)
    # would otherwise hold that client for ever: the silence watchdog sees only an engine that
    # sends nothing at all. Off by default, as in vLLM and SGLang: a long generation queued behind a
    # full batch legitimately runs for many minutes, and only the operator knows how many.
    request_s: Seconds = 0.0


# The largest max_frame_mb: 64 GiB is no message an engine sends; past it is a typo.
MAX_FRAME_MB = 1 << 16


class LimitsConfig(_Section):
    """Bounds on what an engine may send smgd."""

    # The largest frame (one part of a ZMQ message) smgd takes from the engine, in MiB:
    # libzmq refuses a bigger one before allocating it (ZMQ_MAXMSGSIZE) by dropping the
    # engine's connection, and the requests in flight fail (docs/reference/faults.md). The
    # biggest legit frames, measured with smgd's encoders of each wire: an SGLang decode step
    # of 10,000 requests with top-20 logprobs is 3.8 MB (381 B a row); a prompt's logprobs
    # with top-20 come in one message when its prefill ends, 282 B a token, 37 MB for 128k
    # tokens; an embedding step, 37 KB per 4,096-dim vector (float64 msgpack), 38 MB for
    # 1,024 of them. vLLM sends big arrays as frames of their own, each smaller (a 128k
    # prompt's top-20 logprobs: 11 MB). 256 MiB is seven times the 128k prompt; raise it for
    # prompt logprobs past ~900k tokens or embedding steps of over ~7,000 such vectors.
    max_frame_mb: Annotated[int, msgspec.Meta(ge=1, le=MAX_FRAME_MB)] = 256


class EngineConfig(_Section):
    name: str
    wire: WireFamily
    models: list[str]
    model_dir: str
    tokenizer_dir: str | None = None
    ipc_dir: str | None = None
    addresses: Addresses = msgspec.field(default_factory=Addresses)
    launch: LaunchConfig | None = None
    mock: MockConfig = msgspec.field(default_factory=MockConfig)
    timeouts: TimeoutsConfig = msgspec.field(default_factory=TimeoutsConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    structured_output: StructuredOutputConfig = msgspec.field(
        default_factory=StructuredOutputConfig
    )
    lora: LoraConfig | None = None
    max_model_len: ContextLen | None = None  # override what the engine / config.json says
    chat_template: str | None = None  # path to a template file, overrides the tokenizer's
    # How this model writes tool calls and reasoning in its output (vLLM's parser names,
    # smgd.parse's registry): its tool calls become `tool_calls`, its thinking
    # `reasoning_content`.
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    # What the engine's model does: "generate" (completions, chat, /generate) or "embed"
    # (/v1/embeddings: SGLang's --is-embedding, vLLM's --runner pooling, which smgd adds to a
    # launched engine's flags). An engine serves one task, as both engines run one.
    task: Literal["generate", "embed"] = "generate"
    # "priority": the engine runs requests by their `priority` (lower first) and smgd passes it
    # on, launching the engine with its priority flags (SCHEDULING_FLAGS); "fcfs": arrival
    # order, and a request with a non-zero priority is a 400.
    scheduling: Literal["fcfs", "priority"] = "fcfs"
    required: bool = True  # readiness waits for it
    # Admission: requests in flight on this engine before new ones queue; 0 = unlimited.
    max_inflight: Count = 0
    max_queue: Count = 1024
    queue_timeout_s: Seconds = 30.0


class Config(_Section):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    admin: AdminConfig = msgspec.field(default_factory=AdminConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    routing: RoutingConfig = msgspec.field(default_factory=RoutingConfig)
    # Where ipc sockets live unless an engine says otherwise. Unix socket paths are limited
    # to 107 bytes, so this defaults to a short per-user directory, not the repo.
    run_dir: str | None = None
    engines: list[EngineConfig] = msgspec.field(default_factory=list)
    # Directory of the file it was loaded from; relative paths resolve against it.
    base_dir: str = "."


# --------------------------------------------------------------------------- loading

_AT_PATH = re.compile(r"^(?P<msg>.*?)(?: - at `(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<field>[^`]*)`")


def _fields_of(path: str, root: type[msgspec.Struct]) -> list[str]:
    """Field names valid at a msgspec path like ``$.engines[0].launch``."""
    struct: Any = root
    for part in re.findall(r"\.(\w+)", path):
        fields = {f.name: f for f in msgspec.structs.fields(struct)}
        if part not in fields:
            return []
        typ = fields[part].type
        struct = _struct_in(typ)
        if struct is None:
            return []
    return [f.name for f in msgspec.structs.fields(struct)]


def _struct_in(typ: Any) -> type[msgspec.Struct] | None:
    if isinstance(typ, type) and issubclass(typ, msgspec.Struct):
        return typ
    for arg in getattr(typ, "__args__", ()):
        found = _struct_in(arg)
        if found is not None:
            return found
    return None


def _type_at(path: str, root: type[msgspec.Struct]) -> msgspec.inspect.Type | None:
    """The schema's type at a msgspec path like ``$.engines[0].mock.step_ms`` (None: unknown)."""
    node: msgspec.inspect.Type = msgspec.inspect.type_info(root)
    for part in re.findall(r"\.(\w+)|\[(?:\d+|\.\.\.)\]", path):
        node = _unwrap(node)
        if part == "":  # a list index, or msgspec's [...] for any key of a table
            if isinstance(node, msgspec.inspect.ListType):
                node = node.item_type
            elif isinstance(node, msgspec.inspect.DictType):
                node = node.value_type
            else:
                return None
        elif isinstance(node, msgspec.inspect.StructType):
            fields = {f.name: f.type for f in node.fields}
            if part not in fields:
                return None
            node = fields[part]
        else:
            return None
    return _unwrap(node)


def _unwrap(node: msgspec.inspect.Type) -> msgspec.inspect.Type:
    """``X | None`` -> ``X``."""
    if isinstance(node, msgspec.inspect.UnionType):
        rest = [t for t in node.types if not isinstance(t, msgspec.inspect.NoneType)]
        if len(rest) == 1:
            return rest[0]
    return node


def _choices(node: msgspec.inspect.Type | None) -> list[str]:
    if isinstance(node, msgspec.inspect.EnumType):
        return [str(member.value) for member in node.cls]
    if isinstance(node, msgspec.inspect.LiteralType):
        return [str(value) for value in node.values]
    return []


def _describe_range(node: msgspec.inspect.Type | None) -> str | None:
    """``a finite number >= 0 and <= 86400.0`` for a bounded int/float type, else None."""
    if not isinstance(node, msgspec.inspect.IntType | msgspec.inspect.FloatType):
        return None
    kind = "an integer" if isinstance(node, msgspec.inspect.IntType) else "a finite number"
    low = f"> {node.gt!r}" if node.gt is not None else f">= {node.ge!r}"
    high = f"< {node.lt!r}" if node.lt is not None else f"<= {node.le!r}"
    return f"{kind} {low} and {high}"


def _translate(err: msgspec.ValidationError, root: type[msgspec.Struct] = Config) -> ConfigError:
    match = _AT_PATH.match(str(err))
    assert match is not None
    msg, path = match["msg"], match["path"] or "$"
    hint = None
    if unknown := _UNKNOWN.match(msg):
        field = unknown["field"]
        # base_dir is smgd's own (the config file's directory), never a key to write.
        valid = [name for name in _fields_of(path, root) if name != "base_dir"]
        close = difflib.get_close_matches(field, valid, n=1)
        path = f"{path}.{field}"
        msg = f"unknown key `{field}`"
        hint = f"did you mean `{close[0]}`?" if close else f"valid keys: {', '.join(valid)}"
    elif "Invalid enum value" in msg:
        if choices := _choices(_type_at(path, root)):
            hint = "one of " + ", ".join(choices)
    elif msg.startswith("Object missing required field"):
        field = msg.split("`")[1]
        path = f"{path}.{field}"
        msg = f"missing required key `{field}`"
    elif (wanted := _describe_range(_type_at(path, root))) is not None:
        # msgspec says "Expected `float` >= 0.0" for a NaN as for -1: say the whole range.
        hint = f"{path.rsplit('.', 1)[-1]} is {wanted}"
    return ConfigError(msg, path=path, hint=hint)


def _parse_literal(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(tree: dict[str, Any], dotted: list[str], value: Any, origin: str) -> None:
    node: Any = tree
    at = "$"  # the key path walked so far, for the errors
    for i, key in enumerate(dotted):
        last = i == len(dotted) - 1
        if isinstance(node, list):
            if not key.isdigit():
                raise ConfigError(f"{origin}: `{key}` is not a list index", path=at)
            idx = int(key)
            if idx >= len(node):
                raise ConfigError(
                    f"{origin}: index {idx} is past the end ({len(node)} entries)", path=at
                )
            if last:
                node[idx] = value
            else:
                node = node[idx]
            at += f"[{idx}]"
        elif isinstance(node, dict):
            if last:
                node[key] = value
            else:
                node = node.setdefault(key, {})
            at += f".{key}"
        else:
            # `server.port.x` where the file (or an earlier override) gives server.port a value:
            # a scalar has no keys to set.
            raise ConfigError(
                f"{origin}: {at} is a value ({node!r}), not a table: it has no key `{key}`",
                path=at,
            )


# Top-level scalar keys reachable as SMGD_<KEY> (no section); SMGD_CONFIG is the file path.
_TOP_LEVEL_ENV = {"RUN_DIR": "run_dir"}


def env_overrides(environ: Mapping[str, str]) -> Iterator[tuple[list[str], Any, str]]:
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :]
        if rest in _TOP_LEVEL_ENV:
            yield [_TOP_LEVEL_ENV[rest]], _parse_literal(raw), name
        elif "__" in rest:
            yield [part.lower() for part in rest.split("__")], _parse_literal(raw), name


def scalar_flags() -> Iterator[tuple[str, str, Any]]:
    """(flag, dotted path, type) for every scalar key of the fixed sections."""
    for section in msgspec.structs.fields(Config):
        struct = _struct_in(section.type)
        if struct is None or section.name == "engines":
            continue
        for field in msgspec.structs.fields(struct):
            if _struct_in(field.type) is None and not str(field.type).startswith("dict"):
                flag = f"--{section.name}-{field.name}".replace("_", "-")
                yield flag, f"{section.name}.{field.name}", field.type


def load_config(
    path: str | os.PathLike[str] | None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: list[str] | None = None,
    check_paths: bool = True,
) -> Config:
    """Read, merge overrides, validate. Raises :class:`ConfigError` (with the key path)."""
    tree: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        file = Path(path)
        text = read_utf8(file, hint="TOML files are UTF-8; save the file as UTF-8")
        try:
            tree = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{file} is not valid TOML: {exc}", path="$") from None
        base = file.resolve().parent
    if "base_dir" in tree:
        raise ConfigError("unknown key `base_dir`", path="$.base_dir", hint="set by smgd")
    tree["base_dir"] = str(base)
    for dotted, value, origin in env_overrides(os.environ if environ is None else environ):
        _set_path(tree, dotted, value, origin)
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE", path="$")
        _set_path(tree, key.strip().split("."), _parse_literal(raw.strip()), f"--set {key}")
    try:
        config = msgspec.convert(tree, Config, strict=True)
    except msgspec.ValidationError as exc:
        raise _translate(exc) from None
    validate(config, check_paths=check_paths)
    return config


def _check_admin_exposure(admin: AdminConfig) -> None:
    """An admin listener reachable from other hosts needs a token: reload and drain are not
    for whoever can reach the port (loopback and the unix socket trust the host's users)."""
    if admin.port == 0 or admin.token_env is not None or _is_loopback(admin.host):
        return
    raise ConfigError(
        f"the admin listener on {admin.host}:{admin.port} is reachable from other hosts "
        "but has no token",
        path="$.admin.token_env",
        hint="set admin.token_env to an env var holding a bearer token, or admin.host = "
        '"127.0.0.1"',
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def _check_workers(config: Config, served: dict[str, str]) -> None:
    """Every model must have an engine in every worker's share (engines[i], i % workers)."""
    count = config.server.workers
    if count == 1:
        return
    for model in served:
        owners = {i % count for i, e in enumerate(config.engines) if model in e.models}
        missing = sorted(set(range(count)) - owners)
        if missing:
            raise ConfigError(
                f"workers = {count}, but model {model!r} has no engine in worker "
                f"{missing[0]} (worker k runs engines[i] with i % {count} == k)",
                path="$.server.workers",
                hint=f"serve {model!r} from {count}+ interleaved engines, or lower workers",
            )


def load_mock_script(path: Path) -> MockScript:
    """Read a mock engine script; :class:`ConfigError` says what is wrong where in the file."""
    text = read_utf8(path, what="mock script ", hint="TOML files are UTF-8")
    try:
        tree = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"mock script {path} is not valid TOML: {exc}") from None
    try:
        return msgspec.convert(tree, MockScript, strict=True)
    except msgspec.ValidationError as exc:
        inner = _translate(exc, MockScript)
        where = inner.path.removeprefix("$.") if inner.path != "$" else "the top level"
        raise ConfigError(
            f"mock script {path}: {inner.message} at {where}", hint=inner.hint
        ) from None


def _check_parser(name: str | None, registry: Mapping[str, object], path: str) -> None:
    if name is None or name in registry:
        return
    kind = path.rsplit(".", 1)[-1].replace("_", " ")
    close = difflib.get_close_matches(name, list(registry), n=1)
    valid = "valid: " + ", ".join(sorted(registry))
    raise ConfigError(
        f"unknown {kind} {name!r}",
        path=path,
        hint=f"did you mean `{close[0]}`? {valid}" if close else valid,
    )


def resolve_path(config: Config, value: str) -> Path:
    """``value`` as a path: ``builtin:<name>`` is a packaged directory (smgd.assets);
    ``~`` expands; a relative path resolves against the config file's directory."""
    try:
        builtin = builtin_dir(value)
    except KeyError:
        raise ConfigError(
            f"{value!r} names no built-in directory", path="$", hint=_BUILTINS
        ) from None
    if builtin is not None:
        return builtin
    path = Path(value).expanduser()
    return path if path.is_absolute() else Path(config.base_dir) / path


def is_mock(engine: EngineConfig) -> bool:
    return engine.wire is WireFamily.MOCK or (
        engine.launch is not None and engine.launch.kind == "mock"
    )


def has_grammar(engine: EngineConfig) -> bool:
    """Whether smgd sends this engine constrained requests (else a 400 before sending): not
    with backend "none", nor to the mock engine unless its config names a backend."""
    backend = engine.structured_output.backend
    return backend != "none" and not (backend == "auto" and is_mock(engine))


def engine_wire(engine: EngineConfig) -> str:
    """The wire an engine speaks (a mock engine speaks its ``mock.wire``)."""
    return engine.mock.wire if engine.wire is WireFamily.MOCK else engine.wire.value


# Wires with an embedding request (TokenSpeed's has none).
EMBED_WIRES = frozenset({"sglang", "vllm"})


def _check_task(engine: EngineConfig, at: str, tasks: dict[str, tuple[str, str]]) -> None:
    """``task = "embed"`` needs a wire with embedding requests, and nothing of generation;
    every engine serving one model name serves it for the same task."""
    if engine.task == "embed":
        if engine_wire(engine) not in EMBED_WIRES:
            raise ConfigError(
                f"the {engine_wire(engine)} wire has no embedding request",
                path=f"{at}.task",
                hint="serve embeddings from an sglang or vllm engine",
            )
        for key in ("tool_parser", "reasoning_parser"):
            if getattr(engine, key) is not None:
                raise ConfigError(
                    f"{key} applies to generated text; an embedding engine writes none",
                    path=f"{at}.{key}",
                )
    for model in engine.models:
        task, other = tasks.setdefault(model, (engine.task, engine.name))
        if task != engine.task:
            raise ConfigError(
                f"model {model!r} is served for {task!r} by engine {other!r} and for "
                f"{engine.task!r} here",
                path=f"{at}.task",
                hint="every engine serving a model name serves it for the same task",
            )


def sglang_has_tokenizer(engine: EngineConfig) -> bool:
    """Whether this engine is an SGLang scheduler smgd launches with the model's tokenizer
    loaded: the launcher's default, since its grammar backend compiles against it; not with
    ``--skip-tokenizer-init`` or grammar backend "none" (the launcher then skips it). Unknown,
    so False, for a scheduler smgd does not launch."""
    launch = engine.launch
    if launch is None or launch.kind != "sglang" or engine.structured_output.backend == "none":
        return False
    args = launch.args
    grammar_none = "--grammar-backend=none" in args or any(
        a == "--grammar-backend" and b == "none" for a, b in itertools.pairwise(args)
    )
    return "--skip-tokenizer-init" not in args and not grammar_none


def _check_structured_output(engine: EngineConfig, at: str) -> None:
    so = engine.structured_output
    at_so = f"{at}.structured_output"
    wire = engine.wire.value
    if not is_mock(engine) and so.backend not in GRAMMAR_BACKENDS[wire]:
        raise ConfigError(
            f"the {wire} engine has no grammar backend {so.backend!r}",
            path=f"{at_so}.backend",
            hint="one of " + ", ".join(sorted(GRAMMAR_BACKENDS[wire])),
        )
    if so.disable_any_whitespace and so.backend not in COMPACT_JSON_BACKENDS:
        raise ConfigError(
            f"grammar backend {so.backend!r} cannot disable free whitespace",
            path=f"{at_so}.disable_any_whitespace",
            hint="use backend xgrammar (or llguidance on SGLang, guidance on vLLM)",
        )
    launch = engine.launch
    flags = GRAMMAR_FLAGS.get(launch.kind, ()) if launch is not None else ()
    if launch is not None and so != StructuredOutputConfig():
        for arg in launch.args:
            if arg.startswith(flags):
                raise ConfigError(
                    f"launch.args sets {arg.split('=')[0]} and [engines.structured_output] is "
                    "set too",
                    path=f"{at}.launch.args",
                    hint="set the grammar backend in one place",
                )


def _check_lora(config: Config, served: Mapping[str, str], *, check_paths: bool) -> None:
    """Adapter names: well formed, not a served model's, one meaning across engines; adapter
    directories exist; the engine can serve adapters; the flags are set in one place."""
    owners: dict[str, tuple[int, str, frozenset[str]]] = {}
    for i, engine in enumerate(config.engines):
        lora = engine.lora
        if lora is None:
            continue
        at = f"$.engines[{i}].lora"
        if engine.wire is WireFamily.TOKENSPEED:
            raise ConfigError(
                "smgd serves no LoRA adapters on the tokenspeed wire",
                path=at,
                hint="remove [engines.lora]",
            )
        launch = engine.launch
        flags = LORA_FLAGS.get(launch.kind, ()) if launch is not None else ()
        for arg in launch.args if launch is not None else ():
            if arg.split("=")[0] in flags:
                raise ConfigError(
                    f"launch.args sets {arg.split('=')[0]} and [engines.lora] is set too",
                    path=f"$.engines[{i}].launch.args",
                    hint="set LoRA in [engines.lora] alone",
                )
        for name, value in lora.adapters.items():
            key = f"{at}.adapters.{name}"
            if not LORA_NAME.fullmatch(name):
                raise ConfigError(
                    f"adapter name {name!r} must be 1-128 of [A-Za-z0-9_.-/] (no ':' or ',')",
                    path=key,
                )
            if name in served:
                raise ConfigError(
                    f"adapter name {name!r} is a model name (engine {served[name]})",
                    path=key,
                    hint="an adapter is addressed as a model: give it a name of its own",
                )
            path = str(resolve_path(config, value))
            models = frozenset(engine.models)
            known = owners.setdefault(name, (i, path, models))
            if known[2] != models:
                raise ConfigError(
                    f"adapter {name!r} is on engines[{known[0]}] too, which serves other "
                    "models: a request for it could not tell which base model to run",
                    path=key,
                )
            if check_paths and not (Path(path) / "adapter_config.json").is_file():
                raise ConfigError(
                    f"adapter {name!r}: {path} has no adapter_config.json",
                    path=key,
                    hint="point it at a PEFT adapter directory",
                )
    count = config.server.workers
    for name, (i, _, _) in owners.items() if count > 1 else ():
        holders = {
            j % count for j, e in enumerate(config.engines) if e.lora and name in e.lora.adapters
        }
        missing = sorted(set(range(count)) - holders)
        if missing:
            raise ConfigError(
                f"workers = {count}, but adapter {name!r} is on no engine of worker "
                f"{missing[0]} (worker k runs engines[i] with i % {count} == k)",
                path=f"$.engines[{i}].lora.adapters.{name}",
                hint="name it on an engine of every worker",
            )


def _check_scheduling(engine: EngineConfig, at: str) -> None:
    wire = engine.mock.wire if engine.wire is WireFamily.MOCK else engine.wire.value
    if engine.scheduling == "priority" and wire == "tokenspeed":
        raise ConfigError(
            "the tokenspeed engine has no priority scheduling",
            path=f"{at}.scheduling",
            hint='use "fcfs"',
        )
    launch = engine.launch
    if launch is None:
        return
    flags = (
        "--scheduling-policy", "--enable-priority-scheduling",
        "--schedule-low-priority-values-first", "--priority-scheduling",
    )  # fmt: skip
    for arg in launch.args:
        if arg.startswith(flags):
            raise ConfigError(
                f"launch.args sets {arg.split('=')[0]}: smgd sets the scheduling flags",
                path=f"{at}.launch.args",
                hint='set `scheduling = "priority"` instead',
            )


_BUILTINS = "built-in directories: " + ", ".join(BUILTIN_PREFIX + name for name in BUILTIN_DIRS)


def _path_values(config: Config) -> Iterator[tuple[str, str, bool, str | None]]:
    """(value, key path, whether it names a directory, what leaving the key out means; None for
    a required key) for every key that names a path."""
    if config.run_dir is not None:
        default = "$XDG_RUNTIME_DIR/smgd, else /tmp/smgd-<uid>"
        yield config.run_dir, "$.run_dir", True, f"the default run_dir ({default})"
    if config.server.api_keys_file is not None:
        yield config.server.api_keys_file, "$.server.api_keys_file", False, "no key file"
    for i, engine in enumerate(config.engines):
        at = f"$.engines[{i}]"
        yield engine.model_dir, f"{at}.model_dir", True, None
        for key, is_dir, unset in (
            ("tokenizer_dir", True, "the tokenizer files in model_dir"),
            ("ipc_dir", True, "<run_dir>/<engine name>"),
            ("chat_template", False, "the tokenizer's chat template"),
        ):
            value = getattr(engine, key)
            if value is not None:
                yield value, f"{at}.{key}", is_dir, unset
        if engine.mock.script is not None:
            yield engine.mock.script, f"{at}.mock.script", False, "no script (prompts echoed)"
        for name, value in engine.lora.adapters.items() if engine.lora is not None else ():
            yield value, f"{at}.lora.adapters.{name}", True, None


def _check_path_values(config: Config) -> None:
    """Every key that names a path names one, before anything resolves it (so the error names
    the key): not empty (which the code would take as unset, or as the config file's
    directory), and ``builtin:`` only with a packaged directory's name, on a directory key."""
    for value, key, is_dir, unset in _path_values(config):
        if not value.strip():
            raise ConfigError(
                f"empty path {value!r}",
                path=key,
                hint=f"name a {'directory' if is_dir else 'file'}"
                + (f", or leave the key out for {unset}" if unset else ""),
            )
        if not value.startswith(BUILTIN_PREFIX):
            continue
        if value[len(BUILTIN_PREFIX) :] not in BUILTIN_DIRS:
            raise ConfigError(f"{value!r} names no built-in directory", path=key, hint=_BUILTINS)
        if not is_dir:
            raise ConfigError(
                f"{value!r} is a packaged directory; this key names a file",
                path=key,
                hint=f"`{BUILTIN_PREFIX}` names directories shipped with smgd ({_BUILTINS})",
            )


def _check_listeners(config: Config) -> None:
    """Listener hosts are named, and the admin listener does not take the public one's port."""
    server, admin = config.server, config.admin
    for key, host in (("$.server.host", server.host), ("$.admin.host", admin.host)):
        if not host.strip():
            # The socket layer would take "" as every interface: say so if that is meant.
            raise ConfigError(
                f"empty host {host!r}",
                path=key,
                hint='"127.0.0.1" for this host only, "0.0.0.0" (or "::") for every interface',
            )
    if server.port > 0 and admin.port == server.port and _binds_overlap(server.host, admin.host):
        raise ConfigError(
            f"admin.port {admin.port} is server.port too (on {server.host} and {admin.host})",
            path="$.admin.port",
            hint="give the admin listener a port of its own, or 0 for the unix socket "
            "<run_dir>/admin.sock",
        )


def _binds_overlap(a: str, b: str) -> bool:
    """Whether TCP listeners on hosts ``a`` and ``b`` with one port collide: the same host, or
    a wildcard address, which takes the port on every address of its family (``::`` on IPv4's
    too: Linux's listeners are dual-stack unless bindv6only)."""
    if a == b:
        return True
    try:
        x, y = (ipaddress.ip_address(host.strip("[]")) for host in (a, b))
    except ValueError:
        return False  # a host name: which address it binds is known only then
    return any(p.is_unspecified and p.version in (q.version, 6) for p, q in ((x, y), (y, x)))


def validate(config: Config, *, check_paths: bool = True) -> None:
    """Cross-field checks msgspec cannot express."""
    if not config.engines:
        # An empty or half-written file (an editor's, a deploy tool's) must not start, or be
        # reloaded into, a gateway that answers ready and 404s every request.
        raise ConfigError(
            "no engine: smgd would serve nothing",
            path="$.engines",
            hint="add an [[engines]] table (name, wire, models, model_dir); the built-in "
            "default config has one (`smgd init` writes it out)",
        )
    _check_path_values(config)
    _check_listeners(config)
    seen: dict[str, int] = {}
    served: dict[str, str] = {}
    tasks: dict[str, tuple[str, str]] = {}  # model -> (task, engine name)
    for i, engine in enumerate(config.engines):
        at = f"$.engines[{i}]"
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", engine.name):
            raise ConfigError(
                f"engine name {engine.name!r} must be 1-64 of [A-Za-z0-9_.-]", path=f"{at}.name"
            )
        if engine.name in seen:
            raise ConfigError(
                f"duplicate engine name {engine.name!r} (also engines[{seen[engine.name]}])",
                path=f"{at}.name",
                hint="engine names must be unique",
            )
        seen[engine.name] = i
        if not engine.models:
            raise ConfigError("an engine serves at least one model name", path=f"{at}.models")
        for j, model in enumerate(engine.models):
            if not model.strip():
                raise ConfigError(
                    f"model name {model!r} is empty",
                    path=f"{at}.models[{j}]",
                    hint="a model name is what requests send as `model`",
                )
            if model in engine.models[:j]:
                raise ConfigError(
                    f"model name {model!r} is listed twice (also models"
                    f"[{engine.models.index(model)}])",
                    path=f"{at}.models[{j}]",
                )
            served.setdefault(model, engine.name)
        _check_task(engine, at, tasks)
        for key in ("model_dir", "tokenizer_dir"):
            value = getattr(engine, key)
            if value is None:
                continue
            if check_paths and not resolve_path(config, value).is_dir():
                raise ConfigError(
                    f"{key} {value!r} is not a directory",
                    path=f"{at}.{key}",
                    hint="point it at the model's directory (tokenizer.json, config.json), "
                    f"or name the packaged one: {BUILTIN_PREFIX}tiny-model",
                )
        if check_paths and engine.mock.script is not None:
            try:
                load_mock_script(resolve_path(config, engine.mock.script))
            except ConfigError as exc:
                raise ConfigError(exc.message, path=f"{at}.mock.script", hint=exc.hint) from None
        _check_parser(engine.tool_parser, TOOL_PARSERS, f"{at}.tool_parser")
        _check_parser(engine.reasoning_parser, REASONING_PARSERS, f"{at}.reasoning_parser")
        if (
            engine.launch is not None
            and engine.launch.kind == "command"
            and not engine.launch.command
        ):
            raise ConfigError(
                'launch.kind = "command" needs `command`', path=f"{at}.launch.command"
            )
        _check_structured_output(engine, at)
        _check_scheduling(engine, at)
    _check_lora(config, served, check_paths=check_paths)
    _check_workers(config, served)
    _check_cors(config.server)
    _check_socket_paths(config)
    _check_admin_exposure(config.admin)
    for model in config.routing.models:
        if model not in served:
            raise ConfigError(
                f"routing for model {model!r} that no engine serves",
                path=f"$.routing.models.{model}",
            )


# A serialized origin as a browser sends it (RFC 6454 §6.2): scheme://host[:port], lower case,
# no path. "https://ui.example/" (a trailing slash) would never equal any Origin header.
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s@]+")
# An HTTP token (RFC 9110 §5.6.2): what a method or a header name may be.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _check_cors(server: ServerConfig) -> None:
    """CORS keys a browser could never match, and credentials with the "*" origin."""
    for i, origin in enumerate(server.cors_allowed_origins):
        if origin != "*" and not (_ORIGIN.fullmatch(origin) and origin == origin.lower()):
            raise ConfigError(
                f"{origin!r} is not an origin",
                path=f"$.server.cors_allowed_origins[{i}]",
                hint="an origin is scheme://host[:port] in lower case with no path, as browsers "
                'send it ("https://ui.example", "http://localhost:3000"), or "*" for any',
            )
    for key in ("cors_allowed_methods", "cors_allowed_headers"):
        for i, name in enumerate(getattr(server, key)):
            if not _TOKEN.fullmatch(name):
                raise ConfigError(
                    f"{name!r} is not an HTTP token", path=f"$.server.{key}[{i}]", hint='or "*"'
                )
    if server.cors_allow_credentials and "*" in server.cors_allowed_origins:
        raise ConfigError(
            'cors_allow_credentials cannot be used with the origin "*"',
            path="$.server.cors_allow_credentials",
            hint="browsers refuse credentialed responses to any origin (Fetch standard); "
            "list the origins that may send credentials",
        )


# The unix sockets smgd binds: per engine under its ipc dir (smgd.engines: in.sock, out.sock,
# and hs.sock for a vLLM handshake) unless [engines.addresses] names them, and admin.sock in
# run_dir (smgd.api.http.server, admin.port 0). The longest name decides whether a
# directory fits.
ENGINE_SOCKET = "out.sock"
ADMIN_SOCKET = "admin.sock"


def _sockets(config: Config) -> Iterator[tuple[str, str]]:
    """(unix socket path, the key that decides it) for every ipc socket smgd will bind."""
    for i, engine in enumerate(config.engines):
        at = f"$.engines[{i}]"
        addresses = engine.addresses
        named = [addresses.input, addresses.output]
        if engine.wire is WireFamily.VLLM:
            named.append(addresses.handshake)
        if not all(named):  # some socket lives in the engine's ipc dir
            key = f"{at}.ipc_dir" if engine.ipc_dir else "$.run_dir"
            yield str(engine_ipc_dir(config, engine) / ENGINE_SOCKET), key
        for name in ("input", "output", "handshake"):
            address = getattr(addresses, name)
            if address is not None and address.startswith("ipc://"):
                yield address[len("ipc://") :], f"{at}.addresses.{name}"
    if config.admin.port == 0:
        yield str(run_dir(config) / ADMIN_SOCKET), "$.run_dir"


# The ZMQ transports an engine's endpoint may use: a unix socket, or TCP (TokenSpeed's
# handshake must be TCP; an engine elsewhere on the host's network may be too).
ADDRESS_SCHEMES = ("ipc://", "tcp://")


def _check_addresses(config: Config) -> None:
    """Refuse at load an endpoint no engine could be reached on, and two engines on one
    socket (each would take the other's outputs for its own, or fail to bind)."""
    admin = str(run_dir(config) / ADMIN_SOCKET) if config.admin.port == 0 else None
    owner: dict[str, str] = {}  # a socket directory or an endpoint -> the engine it is for
    for i, engine in enumerate(config.engines):
        at = f"$.engines[{i}]"
        places: list[tuple[str, str]] = []
        for name in ("input", "output", "handshake"):
            address = getattr(engine.addresses, name)
            if address is None:
                continue
            if not address.startswith(ADDRESS_SCHEMES):
                raise ConfigError(
                    f"{name} address {address!r} is not an ipc:// or tcp:// endpoint",
                    path=f"{at}.addresses.{name}",
                    hint="e.g. ipc:///run/smgd/engine/in.sock or tcp://127.0.0.1:30500",
                )
            if not address.endswith(":*"):  # ":*": any free port, never another's
                places.append((address, f"{at}.addresses.{name}"))
        if not (engine.addresses.input and engine.addresses.output):
            key = f"{at}.ipc_dir" if engine.ipc_dir else f"{at}.name"
            where = str(engine_ipc_dir(config, engine))
            if where == admin:
                raise ConfigError(
                    f"engine {engine.name!r}'s socket directory {where!r} is the admin "
                    "socket's path",
                    path=key,
                    hint="name the engine otherwise, or give it an ipc_dir",
                )
            places.append((where, key))
        for place, key in places:
            if owner.get(place, at) != at:
                raise ConfigError(
                    f"{place!r} is {owner[place]}'s already: two engines cannot share it",
                    path=key,
                    hint="give each engine sockets (or an ipc_dir) of its own",
                )
            owner[place] = at


def _check_socket_paths(config: Config) -> None:
    """Refuse at load a socket path that could not be bound (serve would fail later)."""
    _check_addresses(config)
    for sock, key in _sockets(config):
        size = len(os.fsencode(sock))
        if size <= SUN_PATH_MAX:
            continue
        default = " (default run_dir)" if key == "$.run_dir" and not config.run_dir else ""
        raise ConfigError(
            f"socket path {sock!r}{default} is {size} bytes, over the {SUN_PATH_MAX}-byte "
            "unix socket limit",
            path=key,
            hint="use a shorter directory, e.g. under /run or /tmp",
        )


# --------------------------------------------------------------------------- secrets
# Keys and tokens are read from the environment / a file named in the config, never from the
# config itself. A configured source that yields nothing is an error, never "no auth": an unset
# variable or an emptied file must not silently open the daemon to everyone.


def load_api_keys(config: Config, environ: Mapping[str, str] | None = None) -> tuple[bytes, ...]:
    """Bearer keys from ``server.api_keys_env`` and/or ``server.api_keys_file``; () = no auth
    (neither is set). Raises :class:`ConfigError` for a configured source without a key."""
    server = config.server
    env = os.environ if environ is None else environ
    keys: list[str] = []
    if server.api_keys_env is not None:
        found = [k.strip() for k in env.get(server.api_keys_env, "").split(",") if k.strip()]
        if not found:
            raise ConfigError(
                f"{server.api_keys_env or '(empty name)'} is unset or empty",
                path="$.server.api_keys_env",
                hint="it must hold the comma-separated API keys; "
                "remove api_keys_env to serve without keys",
            )
        keys += found
    if server.api_keys_file is not None:
        path = resolve_path(config, server.api_keys_file)
        key = "$.server.api_keys_file"
        lines = read_utf8(path, what="api_keys_file ", key=key).splitlines()
        found = [k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")]
        if not found:
            raise ConfigError(
                f"api_keys_file {str(path)!r} holds no key",
                path="$.server.api_keys_file",
                hint="one key per line ('#' starts a comment); "
                "remove api_keys_file to serve without keys",
            )
        keys += found
    return tuple(dict.fromkeys(k.encode() for k in keys))


def load_admin_token(config: Config, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The admin bearer token from ``admin.token_env``; None = not configured.
    Raises :class:`ConfigError` when the variable is configured but unset or empty."""
    name = config.admin.token_env
    if name is None:
        return None
    token = (os.environ if environ is None else environ).get(name, "").strip()
    if not token:
        raise ConfigError(
            f"{name or '(empty name)'} is unset or empty",
            path="$.admin.token_env",
            hint="it must hold the admin token; remove token_env to use no token",
        )
    return token.encode()


def check_secrets(config: Config, environ: Mapping[str, str] | None = None) -> None:
    """Every configured key source yields a key (serve, check-config and reload call this)."""
    load_api_keys(config, environ)
    load_admin_token(config, environ)


def default_run_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "smgd"
    return Path(f"/tmp/smgd-{os.getuid()}")


def run_dir(config: Config) -> Path:
    return resolve_path(config, config.run_dir) if config.run_dir else default_run_dir()


def engine_ipc_dir(config: Config, engine: EngineConfig) -> Path:
    if engine.ipc_dir:
        return resolve_path(config, engine.ipc_dir)
    return run_dir(config) / engine.name


def diff_engines(
    old: Config, new: Config
) -> tuple[list[EngineConfig], list[EngineConfig], list[EngineConfig]]:
    """(added, removed, changed) engines between two configs, matched by name."""
    before = {e.name: e for e in old.engines}
    after = {e.name: e for e in new.engines}
    added = [e for n, e in after.items() if n not in before]
    removed = [e for n, e in before.items() if n not in after]
    changed = [e for n, e in after.items() if n in before and before[n] != e]
    return added, removed, changed

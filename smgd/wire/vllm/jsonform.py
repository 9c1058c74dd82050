"""The JSON form of vLLM V1 EngineCore messages, for ``smgd wire decode|encode --engine vllm``.

A message is its list of frames (the ROUTER identity frame excluded). The walk pairs untyped
msgpack values with the schema of the mirror structs in :mod:`smgd.wire.vllm.structs`: array
structs become ``{field: value}`` (plus ``"_extra"`` for trailing fields this version does not
know; missing trailing fields are simply absent), arrays ``{"dtype", "shape", "data"[, "aux"]}``,
bytes ``{"hex"}``, msgpack ext ``{"ext", "hex"}``, maps with non-string keys
``{"__map__": [[k, v]...]}``, and a value that does not fit its schema ``{"__raw__": value}``.
Encoding walks back to the same untyped values, so the bytes come out identical.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any, Final

import msgspec
from msgspec import inspect as mi
from msgspec.msgpack import Ext

from smgd.errors import WireError
from smgd.wire.vllm.structs import (
    ENGINE_CORE_DEAD,
    RAW_VIEW_EXT,
    EngineCoreOutputs,
    EngineCoreRequest,
    Frame,
    HandshakeMetadata,
    HandshakeStatus,
    ReadyResponse,
    RequestType,
    StartDpWave,
    Tensor,
    UtilityRequest,
)
from smgd.wire.vllm.tensors import flatten, pack_flat, reshape, unpack_flat

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

_ENCODER: Final = msgspec.msgpack.Encoder()


class _WideDict(dict[Any, Any]):
    """A map whose msgpack header is wider than needed (msgspec writes map16 for every
    ``omit_defaults`` struct of more than 15 fields, e.g. SamplingParams)."""

    width = 16


class _WideList(list[Any]):
    width = 16


class _F32(float):
    """A float that travelled as msgpack float32."""


def _wide(v: Any, width: int) -> Any:
    w: _WideDict | _WideList = _WideDict(v) if isinstance(v, dict) else _WideList(v)
    w.width = width
    return w


_INT_FMT: Final = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q"}
_INT_FMT.update({0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"})
_LEN_FMT: Final = {1: ">B", 2: ">H", 4: ">I"}


def _mp_read(b: bytes, i: int) -> tuple[Any, int]:
    """Decode one msgpack value at ``b[i]``, keeping what msgspec would lose: wide container
    headers and float32. Other non-minimal encodings (msgspec never writes them) are refused."""
    c = b[i]
    i += 1
    if c <= 0x7F:
        return c, i
    if c >= 0xE0:
        return c - 0x100, i
    if 0x80 <= c <= 0x9F:
        return _mp_container(b, i, c & 0x0F, is_map=c < 0x90, width=0)
    if 0xA0 <= c <= 0xBF:
        n = c & 0x1F
        return b[i : i + n].decode(), i + n
    if c == 0xC0:
        return None, i
    if c in (0xC2, 0xC3):
        return c == 0xC3, i
    if c in _INT_FMT:
        fmt = _INT_FMT[c]
        size = struct.calcsize(fmt)
        (num,) = struct.unpack_from(fmt, b, i)
        if _ENCODER.encode(num)[0] != c:
            raise WireError(f"vllm: non-minimal msgpack integer {num} at byte {i - 1}")
        return num, i + size
    if c == 0xCA:
        return _F32(struct.unpack_from(">f", b, i)[0]), i + 4
    if c == 0xCB:
        return struct.unpack_from(">d", b, i)[0], i + 8
    if c in (0xD9, 0xDA, 0xDB, 0xC4, 0xC5, 0xC6, 0xC7, 0xC8, 0xC9):
        size = 1 << ((c - 0xD9) if c >= 0xD9 else (c - 0xC4) % 3)
        (n,) = struct.unpack_from(_LEN_FMT[size], b, i)
        i += size
        if c >= 0xD9:
            v: Any = b[i : i + n].decode()
        elif c <= 0xC6:
            v = b[i : i + n]
        else:
            v, n = Ext(struct.unpack_from(">b", b, i)[0], b[i + 1 : i + 1 + n]), n + 1
        if _ENCODER.encode(v)[0] != c:
            raise WireError(f"vllm: non-minimal msgpack length header at byte {i - size - 1}")
        return v, i + n
    if 0xD4 <= c <= 0xD8:
        n = 1 << (c - 0xD4)
        return Ext(struct.unpack_from(">b", b, i)[0], b[i + 1 : i + 1 + n]), i + 1 + n
    if c in (0xDC, 0xDD, 0xDE, 0xDF):
        size = 2 if c in (0xDC, 0xDE) else 4
        (n,) = struct.unpack_from(_LEN_FMT[size], b, i)
        return _mp_container(b, i + size, n, is_map=c >= 0xDE, width=size * 8)
    raise WireError(f"vllm: invalid msgpack byte 0x{c:02x} at {i - 1}")


def _mp_container(b: bytes, i: int, n: int, *, is_map: bool, width: int) -> tuple[Any, int]:
    out: Any
    if is_map:
        out = {}
        for _ in range(n):
            k, i = _mp_read(b, i)
            out[k], i = _mp_read(b, i)
    else:
        out = []
        for _ in range(n):
            x, i = _mp_read(b, i)
            out.append(x)
    # Keep a header only when it is wider than the minimal one for this length.
    minimal = 0 if n < 16 else 16 if n < 1 << 16 else 32
    if width > minimal:
        out = _wide(out, width)
    return out, i


def _mp_decode(buf: bytes) -> Any:
    try:
        value, end = _mp_read(buf, 0)
    except (IndexError, struct.error, UnicodeDecodeError) as exc:
        raise WireError(f"vllm: truncated or invalid msgpack: {exc}") from exc
    if end != len(buf):
        raise WireError(f"vllm: {len(buf) - end} trailing bytes after the msgpack value")
    return value


def _mp_encode(v: Any, out: bytearray) -> None:
    if isinstance(v, dict | list):
        n = len(v)
        width = getattr(v, "width", 0) if isinstance(v, _WideDict | _WideList) else 0
        if width == 0 and n < 16:
            out.append((0x80 if isinstance(v, dict) else 0x90) | n)
        else:
            width = max(width, 16 if n < 1 << 16 else 32)
            code = (0xDE if isinstance(v, dict) else 0xDC) + (width == 32)
            out.append(code)
            out += struct.pack(">H" if width == 16 else ">I", n)
        if isinstance(v, dict):
            for k, x in v.items():
                _mp_encode(k, out)
                _mp_encode(x, out)
        else:
            for x in v:
                _mp_encode(x, out)
    elif isinstance(v, _F32):
        out += b"\xca" + struct.pack(">f", v)
    else:
        out += _ENCODER.encode(v)


_ANY: Final = mi.AnyType()
_SCHEMAS: Final[dict[str, mi.Type]] = {
    name: mi.type_info(t)
    for name, t in {
        "ADD": EngineCoreRequest,
        "ABORT": list[str],
        "UTILITY": UtilityRequest,
        "START_DP_WAVE": StartDpWave,
        "OUTPUTS": EngineCoreOutputs,
        "INIT": HandshakeMetadata,
        "READY_RESPONSE": ReadyResponse,
        "HELLO": HandshakeStatus,
        "READY": HandshakeStatus,
    }.items()
}
_TYPE_BYTES: Final = {t.value: t.name for t in RequestType}
_RESERVED_KEYS: Final = (
    {"hex"},
    {"ext", "hex"},
    {"__map__"},
    {"__raw__"},
    {"f32"},
    {"__wide__", "items"},
)


class _Ctx:
    """Aux frames of the message being converted."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames
        self.used: set[int] = set()


def _g2j(v: Any) -> Any:
    """Untyped msgpack value -> JSON value."""
    if isinstance(v, _WideDict | _WideList):
        return {"__wide__": v.width, "items": _g2j(dict(v) if isinstance(v, dict) else list(v))}
    if isinstance(v, _F32):
        return {"f32": float(v)}
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, list):
        return [_g2j(x) for x in v]
    if isinstance(v, dict):
        if all(isinstance(k, str) for k in v) and set(v) not in _RESERVED_KEYS:
            return {k: _g2j(x) for k, x in v.items()}
        return {"__map__": [[_g2j(k), _g2j(x)] for k, x in v.items()]}
    if isinstance(v, bytes):
        return {"hex": v.hex()}
    if isinstance(v, Ext):
        return {"ext": v.code, "hex": bytes(v.data).hex()}
    raise WireError(f"vllm: unexpected value of type {type(v).__name__}")


def _j2g(v: Any) -> Any:
    """JSON value -> untyped msgpack value."""
    if isinstance(v, list):
        return [_j2g(x) for x in v]
    if isinstance(v, dict):
        keys = set(v)
        if keys == {"hex"}:
            return bytes.fromhex(v["hex"])
        if keys == {"ext", "hex"}:
            return Ext(v["ext"], bytes.fromhex(v["hex"]))
        if keys == {"__map__"}:
            return {_j2g(k): _j2g(x) for k, x in v["__map__"]}
        if keys == {"__raw__"}:
            return _j2g(v["__raw__"])
        if keys == {"f32"}:
            return _F32(v["f32"])
        if keys == {"__wide__", "items"}:
            return _wide(_j2g(v["items"]), v["__wide__"])
        return {k: _j2g(x) for k, x in v.items()}
    return v


def _strip_optional(t: mi.Type) -> mi.Type:
    if isinstance(t, mi.UnionType):
        rest = [x for x in t.types if not isinstance(x, mi.NoneType)]
        if len(rest) == 1:
            return rest[0]
    return t


def _is_tensor(t: mi.Type) -> bool:
    return isinstance(t, mi.StructType) and t.cls is Tensor


def _tensor_to_json(v: Any, ctx: _Ctx) -> Any:
    ok = (
        isinstance(v, list)
        and len(v) == 3
        and isinstance(v[0], str)
        and isinstance(v[1], list)
        and all(isinstance(d, int) for d in v[1])
        and isinstance(v[2], Ext | int)
        and not isinstance(v[2], bool)
    )
    if not ok or (isinstance(v[2], Ext) and v[2].code != RAW_VIEW_EXT):
        return {"__raw__": _g2j(v)}
    dtype, shape, data = v
    out: dict[str, Any] = {"dtype": dtype, "shape": shape}
    if isinstance(data, int):
        if not 0 < data < len(ctx.frames):
            raise WireError(f"vllm: array refers to aux frame {data}, message has fewer")
        raw = ctx.frames[data]
        ctx.used.add(data)
    else:
        raw = bytes(data.data)
    flat = unpack_flat(dtype, raw)
    nested = reshape(flat, shape) if flat is not None else None
    # Values only when they re-pack to the very same bytes (NaN payloads, odd sizes: hex).
    if flat is not None and nested is not None and pack_flat(dtype, flat) == raw:
        out["data"] = nested
    else:
        out["data"] = {"hex": raw.hex()}
    if isinstance(data, int):
        out["aux"] = data
    return out


def _tensor_from_json(v: Any, ctx: _Ctx) -> Any:
    if set(v) - {"dtype", "shape", "data", "aux"}:
        raise WireError(f"vllm: unexpected array keys {sorted(set(v))}")
    dtype, shape, data = v["dtype"], v["shape"], v["data"]
    if isinstance(data, dict):
        raw = bytes.fromhex(data["hex"])
    else:
        raw = pack_flat(dtype, flatten(data, len(shape)))
    if "aux" in v:
        idx = v["aux"]
        while len(ctx.frames) <= idx:
            ctx.frames.append(b"")
        ctx.frames[idx] = raw
        ctx.used.add(idx)
        return [dtype, shape, idx]
    return [dtype, shape, Ext(RAW_VIEW_EXT, raw)]


def _to_json(v: Any, t: mi.Type, ctx: _Ctx) -> Any:
    if v is None:
        return None
    t = _strip_optional(t)
    if isinstance(v, _WideDict | _WideList):
        plain = dict(v) if isinstance(v, dict) else list(v)
        inner = _to_json(plain, t, ctx)
        if isinstance(t, mi.StructType) and isinstance(inner, dict) and "__raw__" not in inner:
            inner["__wide__"] = v.width  # struct field names never start with "__"
            return inner
        return {"__wide__": v.width, "items": inner}
    if _is_tensor(t):
        return _tensor_to_json(v, ctx)
    if isinstance(t, mi.StructType):
        fields = t.fields
        if t.array_like:
            if not isinstance(v, list):
                return {"__raw__": _g2j(v)}
            out = {f.name: _to_json(x, f.type, ctx) for f, x in zip(fields, v, strict=False)}
            if len(v) > len(fields):
                out["_extra"] = [_g2j(x) for x in v[len(fields) :]]
            return out
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            return {"__raw__": _g2j(v)}
        by_name = {f.encode_name: f.type for f in fields}
        return {k: _to_json(x, by_name.get(k, _ANY), ctx) for k, x in v.items()}
    if isinstance(t, mi.ListType | mi.SetType | mi.VarTupleType) and isinstance(v, list):
        return [_to_json(x, t.item_type, ctx) for x in v]
    if isinstance(t, mi.DictType) and isinstance(v, dict):
        if all(isinstance(k, str) for k in v) and set(v) not in _RESERVED_KEYS:
            return {k: _to_json(x, t.value_type, ctx) for k, x in v.items()}
        if isinstance(t.key_type, mi.IntType) and all(type(k) is int for k in v):
            return {str(k): _to_json(x, t.value_type, ctx) for k, x in v.items()}
    return _g2j(v)


def _from_json(v: Any, t: mi.Type, ctx: _Ctx) -> Any:
    if v is None:
        return None
    if isinstance(v, dict) and set(v) == {"__raw__"}:
        return _j2g(v["__raw__"])
    t = _strip_optional(t)
    if isinstance(v, dict) and "__wide__" in v:
        rest = dict(v)
        width = rest.pop("__wide__")
        inner = rest["items"] if set(rest) == {"items"} else rest
        return _wide(_from_json(inner, t, ctx), width)
    if _is_tensor(t) and isinstance(v, dict):
        return _tensor_from_json(v, ctx)
    if isinstance(t, mi.StructType) and isinstance(v, dict):
        fields = t.fields
        if t.array_like:
            names = [f.name for f in fields]
            unknown = set(v) - set(names) - {"_extra"}
            if unknown:
                raise WireError(f"vllm: unknown fields {sorted(unknown)} for {t.cls.__name__}")
            present = [i for i, n in enumerate(names) if n in v]
            out = []
            for f in fields[: present[-1] + 1 if present else 0]:
                if f.name in v:
                    out.append(_from_json(v[f.name], f.type, ctx))
                elif f.required:
                    raise WireError(f"vllm: {t.cls.__name__} needs field {f.name!r}")
                else:
                    default = f.default_factory() if callable(f.default_factory) else f.default
                    out.append(msgspec.to_builtins(default))
            out.extend(_j2g(x) for x in v.get("_extra", []))
            return out
        by_name = {f.encode_name: f.type for f in fields}
        return {k: _from_json(x, by_name.get(k, _ANY), ctx) for k, x in v.items()}
    if isinstance(t, mi.ListType | mi.SetType | mi.VarTupleType) and isinstance(v, list):
        return [_from_json(x, t.item_type, ctx) for x in v]
    if isinstance(t, mi.DictType) and isinstance(v, dict) and set(v) not in _RESERVED_KEYS:
        if isinstance(t.key_type, mi.IntType):
            return {int(k): _from_json(x, t.value_type, ctx) for k, x in v.items()}
        return {k: _from_json(x, t.value_type, ctx) for k, x in v.items()}
    return _j2g(v)


def _classify_map(body: dict[Any, Any]) -> str:
    status = body.get("status")
    if status in ("HELLO", "READY"):
        return str(status)
    if "addresses" in body:
        return "INIT"
    if "max_model_len" in body:
        return "READY_RESPONSE"
    raise WireError(f"vllm: unrecognised map message with keys {sorted(map(str, body))[:6]}")


def frames_to_json(message: Sequence[Frame]) -> dict[str, Any]:
    """Any vLLM message (identity frame excluded) -> a JSON-able dict with a ``type`` key:
    HELLO, READY, INIT, READY_RESPONSE, ADD, ABORT, UTILITY, START_DP_WAVE, OUTPUTS or
    ENGINE_CORE_DEAD."""
    frames = [bytes(f) for f in message]
    if not frames:
        raise WireError("vllm: empty message")
    if frames == [ENGINE_CORE_DEAD]:
        return {"type": "ENGINE_CORE_DEAD"}
    if len(frames[0]) == 1 and len(frames) >= 2:
        kind = _TYPE_BYTES.get(frames[0])
        if kind is None:
            raise WireError(f"vllm: unknown request type byte {frames[0].hex()!r}")
        head: dict[str, Any] = {"type": kind}
        body_frames = frames[1:]
    else:
        head = {}
        body_frames = frames
    body = _mp_decode(body_frames[0])
    ctx = _Ctx(body_frames)
    if not head:
        if isinstance(body, dict):
            head = {"type": _classify_map(body)}
        elif isinstance(body, list):
            head = {"type": "OUTPUTS"}
        else:
            raise WireError("vllm: message body is neither a map nor an array")
    kind = head["type"]
    schema = _SCHEMAS.get(kind, _ANY)
    if kind == "ADD":
        head["request"] = _to_json(body, schema, ctx)
    elif kind == "ABORT":
        head["request_ids"] = _to_json(body, schema, ctx)
    elif kind in ("EXECUTOR_FAILED", "WAKEUP"):
        head["body"] = _g2j(body)
    else:
        converted = _to_json(body, schema, ctx)
        if not isinstance(converted, dict) or "type" in converted:
            head["body"] = converted
        else:
            head.update(converted)
    extra = {str(i): f.hex() for i, f in enumerate(body_frames) if i and i not in ctx.used}
    if extra:
        head["extra_frames"] = extra
    return head


def json_to_frames(obj: Mapping[str, Any]) -> list[bytes]:
    """Inverse of ``frames_to_json``: byte-identical for anything that came from it."""
    obj = dict(obj)
    kind = obj.pop("type", None)
    if not isinstance(kind, str):
        raise WireError("vllm: JSON message needs a string 'type'")
    if kind == "ENGINE_CORE_DEAD":
        return [ENGINE_CORE_DEAD]
    ctx = _Ctx([b""])
    extra = obj.pop("extra_frames", {})
    schema = _SCHEMAS.get(kind, _ANY)
    if kind == "ADD":
        body = _from_json(obj.pop("request"), schema, ctx)
    elif kind == "ABORT":
        body = _from_json(obj.pop("request_ids"), schema, ctx)
    elif "body" in obj:
        body = _from_json(obj.pop("body"), schema, ctx)
    elif kind in _SCHEMAS:
        body, obj = _from_json(obj, schema, ctx), {}
    else:
        raise WireError(f"vllm: unknown message type {kind!r}")
    if obj:
        raise WireError(f"vllm: unexpected keys {sorted(obj)} in a {kind} message")
    for idx, hexdata in extra.items():
        i = int(idx)
        while len(ctx.frames) <= i:
            ctx.frames.append(b"")
        ctx.frames[i] = bytes.fromhex(hexdata)
    encoded = bytearray()
    _mp_encode(body, encoded)
    frames = [bytes(encoded), *ctx.frames[1:]]
    if kind in RequestType.__members__:
        return [RequestType[kind].value, *frames]
    return frames

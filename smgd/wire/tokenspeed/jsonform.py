"""The JSON form of TokenSpeed messages, for ``smgd wire decode|encode --engine tokenspeed``.

It names every field and re-encodes byte-identically; it works on the generic msgpack value so
short prefixes, extra trailing elements and ints in float slots survive a round trip.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import msgspec

from smgd.errors import WireError
from smgd.wire.tokenspeed.decode import decode_as, decode_identity
from smgd.wire.tokenspeed.engine_side import encode_identity
from smgd.wire.tokenspeed.structs import (
    ENGINE_CORE_DEAD,
    REQ_ABORT,
    REQ_ADD,
    TAG_OUTPUT,
    TAG_REQUEST,
    BatchTokenIDOutSlim,
    HandshakeInit,
    ReadyMessage,
    Registration,
    SamplingParams,
    SessionParams,
    TokenizedGenerateReqInput,
)

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

_ENC = msgspec.msgpack.Encoder()

_DEC_READY = msgspec.msgpack.Decoder(ReadyMessage)
_DEC_INIT = msgspec.msgpack.Decoder(HandshakeInit)
_DEC_REG = msgspec.msgpack.Decoder(Registration)
_DEC_SAMPLING = msgspec.msgpack.Decoder(SamplingParams)
_DEC_ANY = msgspec.msgpack.Decoder()


_RESERVED = ("type", "request_type", "identity", "aux")
_REQUEST_TYPES = {REQ_ADD: "ADD", REQ_ABORT: "ABORT"}
_TAGGED: dict[str, type[msgspec.Struct]] = {
    TAG_REQUEST: TokenizedGenerateReqInput,
    TAG_OUTPUT: BatchTokenIDOutSlim,
}
_NESTED: dict[tuple[str, str], type[msgspec.Struct]] = {
    (TAG_REQUEST, "sampling_params"): SamplingParams,
    (TAG_REQUEST, "session_params"): SessionParams,
}
_MAP_TYPES = (
    ("WireReadyMessage", "status", _DEC_READY),
    ("WireHandshakeInitMessage", "addresses", _DEC_INIT),
    ("WireEngineCoreReadyResponse", "max_model_len", _DEC_REG),
)


def _to_json_value(v: Any) -> Any:
    """A generic msgpack value → JSON-safe, reversibly (bytes, ext, odd keys, non-finite)."""
    if isinstance(v, bool | int | str) or v is None:
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"$float": repr(v)}
    if isinstance(v, list | tuple):
        return [_to_json_value(x) for x in v]
    if isinstance(v, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in v):
            return {k: _to_json_value(x) for k, x in v.items()}
        return {"$map": [[_to_json_value(k), _to_json_value(x)] for k, x in v.items()]}
    if isinstance(v, bytes | bytearray | memoryview):
        return {"$bytes": bytes(v).hex()}
    if isinstance(v, msgspec.msgpack.Ext):
        return {"$ext": v.code, "hex": bytes(v.data).hex()}
    raise WireError(f"tokenspeed: cannot represent {type(v).__name__} in JSON")


def _from_json_value(v: Any) -> Any:
    if isinstance(v, list):
        return [_from_json_value(x) for x in v]
    if isinstance(v, dict):
        if "$float" in v:
            return float(v["$float"])
        if "$map" in v:
            return {_from_json_value(k): _from_json_value(x) for k, x in v["$map"]}
        if "$bytes" in v:
            return bytes.fromhex(v["$bytes"])
        if "$ext" in v:
            return msgspec.msgpack.Ext(int(v["$ext"]), bytes.fromhex(v["hex"]))
        return {k: _from_json_value(x) for k, x in v.items()}
    return v


def _named(cls: type[msgspec.Struct], values: list[Any], owner: str) -> dict[str, Any]:
    """Positional values → {field: value} for the elements present (+ ``_extra`` beyond)."""
    names = cls.__struct_fields__
    out: dict[str, Any] = {}
    for name, value in zip(names, values, strict=False):
        nested = _NESTED.get((owner, name))
        if nested is not None and isinstance(value, list):
            out[name] = _named(nested, value, nested.__name__)
        else:
            out[name] = _to_json_value(value)
    if len(values) > len(names):
        out["_extra"] = _to_json_value(values[len(names) :])
    return out


def _default(cls: type[msgspec.Struct], name: str) -> Any:
    for field in msgspec.structs.fields(cls):
        if field.name == name:
            if field.default is not msgspec.NODEFAULT:
                return msgspec.to_builtins(field.default)
            if field.default_factory is not msgspec.NODEFAULT:
                return msgspec.to_builtins(field.default_factory())
    raise WireError(f"tokenspeed: {cls.__name__}.{name} is required")


def _positional(cls: type[msgspec.Struct], obj: Mapping[str, Any], owner: str) -> list[Any]:
    """{field: value} → positional values up to the last field given (gaps get defaults)."""
    names = cls.__struct_fields__
    unknown = set(obj) - set(names) - {"_extra", *_RESERVED}
    if unknown:
        raise WireError(f"tokenspeed: unknown {cls.__name__} fields {sorted(unknown)}")
    present = [i for i, name in enumerate(names) if name in obj]
    values: list[Any] = []
    for name in names[: present[-1] + 1 if present else 0]:
        if name not in obj:
            values.append(_default(cls, name))
            continue
        value, nested = obj[name], _NESTED.get((owner, name))
        if nested is not None and isinstance(value, dict):
            values.append(_positional(nested, value, nested.__name__))
        else:
            values.append(_from_json_value(value))
    if "_extra" in obj:
        values.extend(_from_json_value(obj["_extra"]))
    return values


def _payload_to_json(payload: bytes) -> dict[str, Any]:
    """One msgpack payload frame → {"type": ..., fields...}."""
    value = decode_as(_DEC_ANY, payload, "frame")
    if isinstance(value, list):
        head = value[0] if value else None
        if isinstance(head, str) and head in _TAGGED:
            cls = _TAGGED[head]
            decode_as(msgspec.msgpack.Decoder(cls), payload, head)  # validate the types
            return {"type": head, **_named(cls, value[1:], head)}
        if all(isinstance(x, str) for x in value):
            return {"type": "AbortPayload", "rids": value}
        if isinstance(head, str):
            raise WireError(f"tokenspeed: unknown struct tag {head!r}")
        decode_as(_DEC_SAMPLING, payload, "SamplingParams")
        return {"type": "SamplingParams", **_named(SamplingParams, value, "SamplingParams")}
    if isinstance(value, dict):
        for name, key, decoder in _MAP_TYPES:
            if key in value:
                decode_as(decoder, payload, name)
                fields = _to_json_value(value)
                if set(fields) & set(_RESERVED):
                    raise WireError(f"tokenspeed: {name} uses a reserved JSON key")
                return {"type": name, **fields}
    raise WireError(f"tokenspeed: unrecognised frame ({type(value).__name__})")


def _frame_to_json(frame: bytes) -> dict[str, Any]:
    if len(frame) == 1:
        return {"type": "RequestTypeFrame", "request_type": _REQUEST_TYPES.get(frame, frame[0])}
    if frame == ENGINE_CORE_DEAD:
        return {"type": "EngineCoreDeadSentinel"}
    if len(frame) == 2:
        return {"type": "EngineIdentity", "engine_index": decode_identity(frame)}
    return _payload_to_json(frame)


def frames_to_json(frames: Sequence[bytes | memoryview]) -> dict[str, Any]:
    """One message (its frames; a leading 2-byte ROUTER identity is allowed) → readable JSON.

    A lone frame is classified by shape: request-type byte, engine identity, dead sentinel,
    tagged struct, abort rid list, bare SamplingParams, or a handshake map.
    """
    parts = [bytes(f) for f in frames]
    if not parts:
        raise WireError("tokenspeed: no frames")
    if len(parts) == 1:
        return _frame_to_json(parts[0])
    out: dict[str, Any] = {}
    if len(parts[0]) == 2:
        out["identity"] = decode_identity(parts[0])
        parts = parts[1:]
    if len(parts) >= 2 and len(parts[0]) == 1:
        kind = _REQUEST_TYPES.get(parts[0])
        if kind is None:
            raise WireError(f"tokenspeed: unknown request type byte {parts[0].hex()!r}")
        body = _payload_to_json(parts[1])
        expected = "AbortPayload" if kind == "ABORT" else TAG_REQUEST
        if body["type"] != expected:
            raise WireError(f"tokenspeed: {kind} carries a {body['type']}")
        out = {"type": expected, "request_type": kind, **out, **body}
        aux = parts[2:]
    else:
        out = {**_frame_to_json(parts[0]), **out}
        aux = parts[1:]
    if aux:
        out["aux"] = [a.hex() for a in aux]
    return out


def _payload_from_json(kind: str, obj: Mapping[str, Any]) -> bytes:
    if kind in _TAGGED:
        cls = _TAGGED[kind]
        payload = _ENC.encode([kind, *_positional(cls, obj, kind)])
        decode_as(msgspec.msgpack.Decoder(cls), payload, kind)
        return payload
    if kind == "SamplingParams":
        payload = _ENC.encode(_positional(SamplingParams, obj, kind))
        decode_as(_DEC_SAMPLING, payload, kind)
        return payload
    if kind == "AbortPayload":
        return _ENC.encode(_decode_abort_json(obj))
    for name, _key, decoder in _MAP_TYPES:
        if kind == name:
            fields = {k: v for k, v in obj.items() if k not in _RESERVED}
            payload = _ENC.encode(_from_json_value(fields))
            decode_as(decoder, payload, name)
            return payload
    raise WireError(f"tokenspeed: unknown message type {kind!r}")


def _decode_abort_json(obj: Mapping[str, Any]) -> list[str]:
    rids = obj.get("rids")
    if not isinstance(rids, list) or not all(isinstance(r, str) for r in rids):
        raise WireError("tokenspeed: AbortPayload needs rids: [str, ...]")
    return rids


def _type_byte(code: Any) -> bytes:
    for byte, name in _REQUEST_TYPES.items():
        if code == name:
            return byte
    if isinstance(code, int) and 0 <= code <= 0xFF:
        return bytes([code])
    raise WireError(f"tokenspeed: unknown request_type {code!r}")


def json_to_frames(obj: Mapping[str, Any]) -> list[bytes]:
    """The inverse of :func:`frames_to_json`, byte-identical on anything it produced."""
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise WireError("tokenspeed: JSON message needs a string 'type'")
    frames: list[bytes] = []
    try:
        if "identity" in obj:
            frames.append(encode_identity(int(obj["identity"])))
        if kind == "RequestTypeFrame":
            return [*frames, _type_byte(obj.get("request_type"))]
        if kind == "EngineIdentity":
            return [*frames, encode_identity(int(obj["engine_index"]))]
        if kind == "EngineCoreDeadSentinel":
            frames.append(ENGINE_CORE_DEAD)
        else:
            if "request_type" in obj:
                frames.append(_type_byte(obj["request_type"]))
            frames.append(_payload_from_json(kind, obj))
        frames.extend(bytes.fromhex(a) for a in obj.get("aux", ()))
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"tokenspeed: bad {kind} JSON: {exc}") from None
    return frames

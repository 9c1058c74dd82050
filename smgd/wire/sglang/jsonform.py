"""The JSON form of SGLang scheduler messages, for ``smgd wire decode|encode --engine sglang``.

``{"type": Tag, <field>: <value>, ...}`` in wire order. Token arrays (input_ids, output_ids,
decode_ids) are lists of ints; SamplingParams/SessionParams are objects by field name; bytes are
``{"hex": ...}``; other ext values ``{"ext": code, "hex": ...}``; non-finite floats
``{"float": "inf"|"-inf"|"nan"}``; maps with non-string keys ``{"map": [[k, v], ...]}``; trailing
fields beyond the mirror ``"_extra": [...]``; SGLang messages smgd does not model
``{"type": Tag, "_fields": [...]}``. The JSON is built from the raw msgpack value, so encoding it
back gives the same bytes.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from msgspec.msgpack import Ext

from smgd.errors import WireError
from smgd.wire.sglang.arrays import EXT_ARRAY, Q_META, ext_to_ids, ids_to_ext
from smgd.wire.sglang.decode import decode_any
from smgd.wire.sglang.structs import MODELED, SGLANG_TAGS, SamplingParams, SessionParams

_encoder = msgspec.msgpack.Encoder()
_raw_decoder = msgspec.msgpack.Decoder()  # untyped: ext stays Ext, bin stays bytes

_TOKEN_FIELDS = {"input_ids": 0, "output_ids": 1, "decode_ids": 1}  # list depth above arrays
_NESTED: dict[str, type[msgspec.Struct]] = {
    "sampling_params": SamplingParams,
    "session_params": SessionParams,
}


def _fields(cls: type[msgspec.Struct]) -> tuple[str, ...]:
    return cls.__struct_fields__


def _tokens_to_json(value: Any, depth: int) -> Any:
    if depth and isinstance(value, list):
        return [_tokens_to_json(v, depth - 1) for v in value]
    if type(value) is Ext and value.code == EXT_ARRAY and memoryview(value.data)[:6] == Q_META:
        return ext_to_ids(value)
    return _to_json(value)


def _tokens_from_json(value: Any, depth: int) -> Any:
    if depth and isinstance(value, list):
        return [_tokens_from_json(v, depth - 1) for v in value]
    if isinstance(value, list):
        return ids_to_ext(value)
    return _from_json(value)


def _struct_to_json(tag: str | None, cls: type[msgspec.Struct], values: list[Any]) -> Any:
    names = _fields(cls)
    out: dict[str, Any] = {} if tag is None else {"type": tag}
    for name, value in zip(names, values, strict=False):
        if name in _TOKEN_FIELDS:
            out[name] = _tokens_to_json(value, _TOKEN_FIELDS[name])
        elif name in _NESTED and isinstance(value, list):
            out[name] = _struct_to_json(None, _NESTED[name], value)
        else:
            out[name] = _to_json(value)
    if len(values) > len(names):
        out["_extra"] = [_to_json(v) for v in values[len(names) :]]
    return out


def _to_json(value: Any) -> Any:
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, bytes | bytearray | memoryview):
        return {"hex": bytes(value).hex()}
    if type(value) is Ext:
        return {"ext": value.code, "hex": bytes(value.data).hex()}
    if isinstance(value, list):
        if len(value) == 2 and value[0] == "PickleWrapper" and isinstance(value[1], bytes):
            return {"type": "PickleWrapper", "data": {"hex": value[1].hex()}}
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _to_json(v) for k, v in value.items()}
        return {"map": [[_to_json(k), _to_json(v)] for k, v in value.items()]}
    raise WireError(f"unexpected msgpack value {type(value).__name__}")


def _struct_from_json(obj: dict[str, Any], cls: type[msgspec.Struct]) -> list[Any]:
    names = _fields(cls)
    unknown = set(obj) - set(names) - {"type", "_extra"}
    if unknown:
        raise WireError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    present = [i for i, name in enumerate(names) if name in obj]
    count = present[-1] + 1 if present else 0
    if present != list(range(count)):
        raise WireError(f"{cls.__name__}: only trailing fields may be left out")
    values: list[Any] = []
    for name in names[:count]:
        value = obj[name]
        if name in _TOKEN_FIELDS:
            values.append(_tokens_from_json(value, _TOKEN_FIELDS[name]))
        elif name in _NESTED and isinstance(value, dict):
            values.append(_struct_from_json(value, _NESTED[name]))
        else:
            values.append(_from_json(value))
    values.extend(_from_json(v) for v in obj.get("_extra", ()))
    return values


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if not isinstance(value, dict):
        return value
    keys = set(value)
    if keys == {"hex"}:
        return bytes.fromhex(value["hex"])
    if keys == {"ext", "hex"}:
        return Ext(value["ext"], bytes.fromhex(value["hex"]))
    if keys == {"float"}:
        return float(value["float"])
    if keys == {"map"}:
        return {_from_json(k): _from_json(v) for k, v in value["map"]}
    if keys == {"type", "data"} and value["type"] == "PickleWrapper":
        return ["PickleWrapper", _from_json(value["data"])]
    return {k: _from_json(v) for k, v in value.items()}


def message_to_json(frame: bytes | memoryview) -> dict[str, Any]:
    """One SGLang frame as JSON-ready data (see the section comment for the shape)."""
    decode_any(frame)  # validates against the mirror; raises WireError when malformed
    value = _raw_decoder.decode(frame)
    if not isinstance(value, list):
        return {"type": type(value).__name__, "value": _to_json(value)}
    tag = value[0]
    cls = MODELED.get(tag)
    if cls is None:
        return {"type": tag, "_fields": [_to_json(v) for v in value[1:]]}
    return dict(_struct_to_json(tag, cls, value[1:]))


def json_to_message(obj: dict[str, Any]) -> bytes:
    """The inverse of :func:`message_to_json`: the exact frame bytes."""
    tag = obj.get("type")
    if tag in ("int", "float", "bool", "bytes") and "value" in obj:
        return _encoder.encode(_from_json(obj["value"]))
    if not isinstance(tag, str) or tag not in SGLANG_TAGS:
        raise WireError(f"unknown SGLang message type {tag!r}")
    cls = MODELED.get(tag)
    if cls is None:
        values = [_from_json(v) for v in obj.get("_fields", ())]
    else:
        values = _struct_from_json(obj, cls)
    frame = _encoder.encode([tag, *values])
    decode_any(frame)  # refuse to produce a frame SGLang's decoder would choke on
    return frame


def frames_to_json(frames: list[bytes]) -> dict[str, Any]:
    """``smgd wire decode``: SGLang messages are a single frame."""
    if len(frames) != 1:
        raise WireError(f"an SGLang message is one frame, got {len(frames)}")
    return message_to_json(frames[0])


def json_to_frames(obj: dict[str, Any]) -> list[bytes]:
    """``smgd wire encode``: the inverse of :func:`frames_to_json`."""
    return [json_to_message(obj)]

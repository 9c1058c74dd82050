"""vLLM's arrays (``[dtype, shape, data]``): their bytes as values and back."""

from __future__ import annotations

import math
import struct
import sys
from typing import TYPE_CHECKING, Any, Final

from msgspec.msgpack import Ext

from smgd.errors import WireError
from smgd.wire.vllm.structs import RAW_VIEW_EXT, Frame, Tensor

if TYPE_CHECKING:
    from collections.abc import Sequence


# dtype name -> (struct/memoryview format char, itemsize). numpy names carry their byte order
# in the first character; torch names are native (little-endian on every platform vLLM runs).
_DTYPES: Final[dict[str, tuple[str, int]]] = {
    "bool": ("?", 1),
    "b1": ("?", 1),
    "int8": ("b", 1),
    "i1": ("b", 1),
    "uint8": ("B", 1),
    "u1": ("B", 1),
    "int16": ("h", 2),
    "i2": ("h", 2),
    "uint16": ("H", 2),
    "u2": ("H", 2),
    "int32": ("i", 4),
    "i4": ("i", 4),
    "uint32": ("I", 4),
    "u4": ("I", 4),
    "int64": ("q", 8),
    "i8": ("q", 8),
    "uint64": ("Q", 8),
    "u8": ("Q", 8),
    "float16": ("e", 2),
    "f2": ("e", 2),
    "float32": ("f", 4),
    "f4": ("f", 4),
    "float64": ("d", 8),
    "f8": ("d", 8),
    "bfloat16": ("bf16", 2),
}


def _dtype_format(dtype: str) -> tuple[str, str, int] | None:
    """``(byte order, format, itemsize)`` for a numpy or torch dtype name, None if unknown."""
    order = "<"
    name = dtype
    if dtype[:1] in "<>=|":
        order = {"<": "<", ">": ">", "=": "=", "|": "<"}[dtype[0]]
        name = dtype[1:]
    fmt = _DTYPES.get(name)
    if fmt is None:
        return None
    return order, fmt[0], fmt[1]


def unpack_flat(dtype: str, raw: bytes | memoryview) -> list[Any] | None:
    spec = _dtype_format(dtype)
    if spec is None:
        return None
    order, fmt, size = spec
    if len(raw) % size:
        return None
    count = len(raw) // size
    if fmt == "bf16":
        halves = struct.unpack(f"{order}{count}H", raw)
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in halves]
    if order in "<=" and sys.byteorder == "little" and fmt in "bBhHiIqQfd":
        values: list[Any] = memoryview(raw).cast(fmt).tolist()  # type: ignore[call-overload]
        return values
    return list(struct.unpack(f"{order}{count}{fmt}", raw))


def pack_flat(dtype: str, values: list[Any]) -> bytes:
    spec = _dtype_format(dtype)
    if spec is None:
        raise WireError(f"vllm: unknown array dtype {dtype!r}; give the data as hex")
    order, fmt, _ = spec
    if fmt == "bf16":
        halves = [struct.unpack("<I", struct.pack("<f", v))[0] >> 16 for v in values]
        return struct.pack(f"{order}{len(halves)}H", *halves)
    try:
        return struct.pack(f"{order}{len(values)}{fmt}", *values)
    except struct.error as exc:
        raise WireError(f"vllm: array data does not fit dtype {dtype!r}: {exc}") from exc


def tensor_bytes(t: Tensor, frames: Sequence[Frame]) -> memoryview:
    """The raw bytes of an array, inline or from its aux frame."""
    if isinstance(t.data, Ext):
        return memoryview(t.data.data)
    if not 0 < t.data < len(frames):
        raise WireError(f"vllm: array refers to aux frame {t.data}, message has {len(frames)}")
    return memoryview(frames[t.data])


def tensor_values(t: Tensor, frames: Sequence[Frame]) -> list[Any]:
    """An array as nested Python lists (row-major, following ``shape``)."""
    flat = unpack_flat(t.dtype, tensor_bytes(t, frames))
    if flat is None:
        raise WireError(f"vllm: cannot read array of dtype {t.dtype!r}")
    nested = reshape(flat, t.shape)
    if nested is None:
        raise WireError(f"vllm: array of {len(flat)} items does not have shape {t.shape}")
    return nested  # type: ignore[no-any-return]


def reshape(flat: list[Any], shape: Sequence[int]) -> Any:
    if math.prod(shape) != len(flat):
        return None
    if not shape:
        return flat[0]
    out: Any = flat
    for dim in reversed(shape[1:]):
        out = [out[i : i + dim] for i in range(0, len(out), dim)] if dim else []
    return out


def flatten(values: Any, depth: int) -> list[Any]:
    if depth == 0:
        return [values]
    if depth == 1:
        return list(values)
    return [x for row in values for x in flatten(row, depth - 1)]


def make_tensor(dtype: str, shape: Sequence[int], values: Any) -> Tensor:
    """Build an inline array from nested values (``encode_outputs`` moves big ones to aux)."""
    flat = flatten(values, len(shape))
    return Tensor(dtype, list(shape), Ext(RAW_VIEW_EXT, pack_flat(dtype, flat)))

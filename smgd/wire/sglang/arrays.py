"""SGLang's token id arrays: msgpack ext type 1 holding an ``array.array``."""

from __future__ import annotations

import struct
import sys
from array import array
from typing import TYPE_CHECKING, Any

import msgspec
from msgspec.msgpack import Ext

from smgd.errors import WireError

if TYPE_CHECKING:
    from collections.abc import Sequence


EXT_ARRAY = 1  # msgpack ext code SGLang uses for array.array ("stable wire id")
Q_META = b"\x00\x00\x00\x02\xa1q"  # ext-1 header for typecode "q": u32 BE len 2 + msgpack "q"
_ONE_Q_LEN = len(Q_META) + 8  # the payload of an array of one int64
_unpack_q = struct.Struct("<q").unpack_from  # SGLang's x86-64 hosts write little-endian
_LITTLE = sys.byteorder == "little"  # SGLang writes raw native (x86-64: little-endian) int64


def ids_to_ext(ids: Sequence[int]) -> Ext:
    """Token ids as SGLang's ``array('q')`` ext (what TokenizerManager sends as input_ids)."""
    arr = array("q", ids)
    if not _LITTLE:
        arr.byteswap()
    return Ext(EXT_ARRAY, Q_META + arr.tobytes())


def ext_to_ids(ext: Any) -> list[int]:
    """Decode an ext-1 ``array.array`` payload to a list of ints (any integer typecode)."""
    if type(ext) is not Ext or ext.code != EXT_ARRAY:
        raise WireError(f"expected an int64 array (msgpack ext 1), got {type(ext).__name__}")
    raw = ext.data
    if type(raw) is bytes and len(raw) == _ONE_Q_LEN and raw.startswith(Q_META):
        # One int64, a decode step's usual output: half the time of the general path.
        return [_unpack_q(raw, len(Q_META))[0]]
    data = memoryview(raw)
    try:
        if _LITTLE and data[:6] == Q_META:
            result: list[int] = data[6:].cast("q").tolist()
            return result
        meta_len = int.from_bytes(data[:4], "big")
        typecode = msgspec.msgpack.decode(data[4 : 4 + meta_len])
        if not isinstance(typecode, str) or typecode not in "bBhHiIlLqQ":
            raise WireError(f"array ext with non-integer typecode {typecode!r}")
        arr = array(typecode)
        arr.frombytes(data[4 + meta_len :])
    except (TypeError, ValueError, msgspec.DecodeError) as exc:
        raise WireError(f"malformed array ext: {exc}") from None
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()

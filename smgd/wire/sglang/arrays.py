"""SGLang's token id arrays: msgpack ext type 1 holding an ``array.array``."""

from __future__ import annotations

import struct
import sys
from array import array
from operator import attrgetter
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
# Each of a run of one-int64 payloads, header skipped: (value,) per payload.
_iter_one_q = struct.Struct(f"<{len(Q_META)}xq").iter_unpack
_code, _data = attrgetter("code"), attrgetter("data")
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


def exts_to_ids(column: list[Any]) -> list[list[int]]:
    """:func:`ext_to_ids` of each entry of an ``output_ids`` column.

    A column of one-int64 arrays, what every running request gets from a decode step, is
    checked and decoded as a whole: builtins mapped over it and one ``struct`` pass over the
    joined payloads, no Python call per row (0.57 us a row on the 2-core test VM otherwise,
    half an engine message's decode). Any other column goes row by row.
    """
    if (
        _LITTLE
        and column
        and set(map(type, column)) == {Ext}
        and set(map(_code, column)) == {EXT_ARRAY}
    ):
        payloads = list(map(_data, column))
        if set(map(type, payloads)) == {bytes} and set(map(len, payloads)) == {_ONE_Q_LEN}:
            joined = b"".join(payloads)
            # Every payload starts with Q_META: byte k of each is at k, k + 14, k + 28, ...
            n = len(column)
            if all(joined[k::_ONE_Q_LEN] == Q_META[k : k + 1] * n for k in range(len(Q_META))):
                return [[value] for (value,) in _iter_one_q(joined)]
    return [ext_to_ids(ext) for ext in column]

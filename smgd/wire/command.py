"""``smgd wire decode|encode``: one engine message as hex frames <-> a readable JSON form.

Input for ``decode``: the message's frames as hex, one frame per line (whitespace inside a line
is ignored), or a JSON array of hex strings. A vLLM/TokenSpeed message is its list of frames
without the ROUTER identity frame; an SGLang message is a single frame.
Output of ``encode``: the frames as hex, one per line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import IO, Any

from smgd.errors import SmgdError, WireError
from smgd.wire.sglang import jsonform as sglang_form
from smgd.wire.tokenspeed import jsonform as tokenspeed_form
from smgd.wire.vllm import jsonform as vllm_form

ToJson = Callable[[list[bytes]], dict[str, Any]]
FromJson = Callable[[dict[str, Any]], list[bytes]]

# Each engine's JSON form: (frames -> JSON, JSON -> frames).
_FORMS: dict[str, tuple[ToJson, FromJson]] = {
    "sglang": (sglang_form.frames_to_json, sglang_form.json_to_frames),
    "vllm": (vllm_form.frames_to_json, vllm_form.json_to_frames),
    "tokenspeed": (tokenspeed_form.frames_to_json, tokenspeed_form.json_to_frames),
}


def parse_hex_frames(text: str) -> list[bytes]:
    text = text.strip()
    if not text:
        raise WireError("no input: expected hex frames on stdin")
    if text.startswith("["):
        items = json.loads(text)
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise WireError("expected a JSON array of hex strings")
        lines = items
    else:
        lines = [line for line in text.splitlines() if line.strip()]
    try:
        return [bytes.fromhex("".join(line.split())) for line in lines]
    except ValueError as exc:
        raise WireError(f"not hex: {exc}") from None


def decode_to_json(engine: str, frames: list[bytes]) -> dict[str, Any]:
    return _FORMS[engine][0](frames)


def encode_from_json(engine: str, obj: dict[str, Any]) -> list[bytes]:
    return _FORMS[engine][1](obj)


def run_wire_command(action: str, engine: str, stdin_text: str, out: IO[str]) -> int:
    try:
        if action == "decode":
            obj = decode_to_json(engine, parse_hex_frames(stdin_text))
            out.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
        else:
            try:
                obj = json.loads(stdin_text)
            except json.JSONDecodeError as exc:
                raise WireError(f"stdin is not JSON: {exc}") from None
            for frame in encode_from_json(engine, obj):
                out.write(frame.hex() + "\n")
    except SmgdError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise WireError(f"{engine} {action} failed: {exc}") from None
    return 0

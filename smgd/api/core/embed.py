"""``POST /v1/embeddings``, sans-IO: the request read and checked, the response written.

The request is OpenAI's: ``input`` is a string, a list of strings, a list of token ids or a
list of such lists (each item one embedding, answered in order); ``encoding_format`` is
``float`` (JSON numbers) or ``base64`` (the vector's little-endian float32 bytes, as OpenAI,
vLLM and SGLang send it); ``dimensions`` keeps the first that many dimensions, for a model
trained for it (Matryoshka: vLLM's rule, from the model's ``config.json``); ``user`` is
accepted and ignored; a ``priority`` other than 0 is refused; ``add_special_tokens: false``
(vLLM's) tokenizes strings without the model's special tokens. The trio part (one engine
request per input) is :mod:`smgd.api.core.embed_run`.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any, Literal

from smgd.errors import InvalidRequest
from smgd.sampling import TRUNCATION_UNSUPPORTED

__all__ = [
    "MAX_INPUTS",
    "EmbedInput",
    "EmbedParams",
    "check_dimensions",
    "embedding_response",
    "encode_vector",
    "parse_embed_request",
]

# Inputs one request may carry: OpenAI's own limit for /v1/embeddings (2048 items). Each is an
# engine request; the admission queue still bounds what runs at once.
MAX_INPUTS = 2048
EncodingFormat = Literal["float", "base64"]


@dataclass(frozen=True, slots=True)
class EmbedInput:
    """One item of ``input``: text to tokenize, or token ids as given."""

    text: str | None = None
    ids: list[int] | None = None


@dataclass(frozen=True, slots=True)
class EmbedParams:
    inputs: list[EmbedInput]
    encoding_format: EncodingFormat = "float"
    dimensions: int | None = None
    add_special_tokens: bool = True  # vLLM's field: strings get the model's BOS / EOS


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(value: list[Any], where: str) -> list[int]:
    if not value:
        raise InvalidRequest(f"{where} is an empty list of token ids", param="input")
    if not all(_is_int(t) and t >= 0 for t in value):
        raise InvalidRequest(f"{where} must hold only non-negative token ids", param="input")
    return list(value)


def _inputs(raw: Any) -> list[EmbedInput]:
    if isinstance(raw, str):
        return [EmbedInput(text=raw)]
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest(
            "`input` must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids, and not empty",
            param="input",
        )
    if len(raw) > MAX_INPUTS:
        raise InvalidRequest(
            f"`input` holds {len(raw)} items; at most {MAX_INPUTS} per request", param="input"
        )
    if all(_is_int(t) for t in raw):
        return [EmbedInput(ids=_ids(raw, "`input`"))]
    items: list[EmbedInput] = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            items.append(EmbedInput(text=item))
        elif isinstance(item, list):
            items.append(EmbedInput(ids=_ids(item, f"`input[{i}]`")))
        else:
            raise InvalidRequest(
                f"`input[{i}]` must be a string or a list of token ids", param="input"
            )
    return items


def parse_embed_request(body: dict[str, Any]) -> EmbedParams:
    """The request's parameters, checked (400 naming the parameter)."""
    if "input" not in body:
        raise InvalidRequest("`input` is required", param="input")
    inputs = _inputs(body["input"])
    fmt = body.get("encoding_format", "float")
    if fmt is None:
        fmt = "float"
    if fmt not in ("float", "base64"):
        raise InvalidRequest(
            f"`encoding_format` must be 'float' or 'base64', got {fmt!r}", param="encoding_format"
        )
    dimensions = body.get("dimensions")
    if dimensions is not None and (not _is_int(dimensions) or dimensions < 1):
        raise InvalidRequest("`dimensions` must be a positive integer", param="dimensions")
    # The wires' embedding requests go without a priority (each engine's default order), so a
    # priority that would change it is refused rather than ignored; 0 is every request's.
    priority = body.get("priority")
    if priority is not None and (not _is_int(priority) or priority != 0):
        raise InvalidRequest(
            "`priority` is not supported on /v1/embeddings (inputs run in arrival order); "
            f"omit it or send 0, got {priority!r}",
            param="priority",
        )
    if body.get("truncate_prompt_tokens") is not None:
        raise InvalidRequest(
            f"`truncate_prompt_tokens` is not supported by smgd ({TRUNCATION_UNSUPPORTED})",
            param="truncate_prompt_tokens",
        )
    # Both wires ask the engine for the normalized vector (vLLM's use_activation; SGLang's
    # embedding models normalize); vLLM's per-request switch to raw vectors is not passed on.
    if body.get("normalize") not in (None, True):
        raise InvalidRequest(
            "`normalize` may only be true (the vectors are L2-normalized)", param="normalize"
        )
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise InvalidRequest("`add_special_tokens` must be a boolean", param="add_special_tokens")
    return EmbedParams(
        inputs=inputs, encoding_format=fmt, dimensions=dimensions, add_special_tokens=special
    )


def check_dimensions(dimensions: int | None, model: str, config_json: dict[str, Any]) -> None:
    """vLLM's rule for ``dimensions``: only a Matryoshka model (``is_matryoshka`` or
    ``matryoshka_dimensions`` in its config.json) takes it, within ``[1, hidden_size]`` and,
    when the model lists its dimensions, one of them."""
    if dimensions is None:
        return
    listed = config_json.get("matryoshka_dimensions")
    if not (config_json.get("is_matryoshka") or listed):
        raise InvalidRequest(
            f"Model {model!r} does not support Matryoshka embeddings; `dimensions` must be "
            f"unset (received dimensions={dimensions}).",
            param="dimensions",
        )
    size = config_json.get("hidden_size")
    if isinstance(size, int) and not 1 <= dimensions <= size:
        raise InvalidRequest(
            f"Model {model!r} only supports dimensions in range [1, {size}], got {dimensions}.",
            param="dimensions",
        )
    if isinstance(listed, list) and dimensions not in listed:
        raise InvalidRequest(
            f"Model {model!r} only supports Matryoshka dimensions {listed}, got {dimensions}.",
            param="dimensions",
        )


def encode_vector(vector: list[float], fmt: EncodingFormat) -> list[float] | str:
    """A vector as the response carries it: the floats, or base64 of little-endian float32."""
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embedding_response(
    model: str, vectors: list[list[float]], prompt_tokens: int, fmt: EncodingFormat
) -> dict[str, Any]:
    """OpenAI's ``list`` of ``embedding`` objects, in input order, with usage."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_vector(v, fmt)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }

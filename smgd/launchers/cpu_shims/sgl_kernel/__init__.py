"""Stand-in for ``sgl_kernel`` on CPU: SGLang imports its ``*_cpu`` ops at module load.

Only ``assign_req_to_token_pool_cpu`` runs on the text-only torch-native path, so it is written
here with plain tensor operations. Any other name resolves to a function that raises when
called, so a path we did not expect fails loudly instead of computing garbage. Set
``SGL_KERNEL_SHIM_LOG=FILE`` to record every name SGLang asks for.
"""

from __future__ import annotations

import os
from typing import Any

__version__ = "0.0.0+smgd.cpu.shim"


def _log(message: str) -> None:
    path = os.environ.get("SGL_KERNEL_SHIM_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {message}\n")


def assign_req_to_token_pool_cpu(
    req_pool_indices: Any,
    req_to_token: Any,
    start_offset: Any,
    end_offset: Any,
    out_cache_loc: Any,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of the req->token table.

    Same semantics as SGLang's triton ``assign_req_to_token_pool``: request i takes the next
    ``end - start`` entries of ``out_cache_loc`` into ``req_to_token[row_i, start:end]``.
    """
    del pool_len  # the table's width; the slices below never exceed it
    offset = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        count = end - start
        if count > 0:
            chunk = out_cache_loc[offset : offset + count]
            req_to_token[row, start:end] = chunk.to(req_to_token.dtype)
        offset += count


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    _log(f"getattr {name}")

    def missing(*args: Any, **kwargs: Any) -> Any:
        _log(f"called {name}")
        raise NotImplementedError(f"sgl_kernel CPU shim: {name} is not available")

    missing.__name__ = name
    return missing

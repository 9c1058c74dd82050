"""Pinned host memory on a machine without an accelerator: asked for, not given.

SGLang 0.5.23's LoRA layers and backends allocate their index tensors with ``pin_memory=True``
unconditionally, and a CPU-only torch refuses that ("pin_memory=True requires a CUDA or other
accelerator backend"), so ``--enable-lora`` cannot start on CPU. Pinning only speeds host to
device copies, of which a CPU run has none: with no accelerator present, torch's factory
functions here ignore ``pin_memory`` and ``Tensor.pin_memory()`` returns the tensor itself.

The SGLang launcher (``--cpu-shims``) imports this before SGLang, and puts its directory on
``PYTHONPATH``, where ``sitecustomize`` imports it in any process the scheduler starts. With an
accelerator, or without torch, it changes nothing.
"""

from __future__ import annotations

import functools
from typing import Any


def _unpinned(factory: Any) -> Any:
    @functools.wraps(factory)
    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return call


def _install() -> None:
    try:
        import torch  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return
    accelerator = getattr(torch, "accelerator", None)
    if torch.cuda.is_available() or (accelerator is not None and accelerator.is_available()):
        return
    for name in ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange"):
        setattr(torch, name, _unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


_install()

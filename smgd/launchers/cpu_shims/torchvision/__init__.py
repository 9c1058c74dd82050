"""Import-only stand-in for ``torchvision`` on CPU.

PyPI's torchvision wheels are CUDA builds: against the CPU torch they fail to load, and a
matching one drags in a CUDA torch (gigabytes). SGLang imports torchvision at module level only
from multimodal model configs that a text-only Llama never uses. Every ``torchvision.*``
submodule imports, every attribute is a placeholder class, and instantiating one raises.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+smgd.cpu.shim"


class _PlaceholderMeta(type):
    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _placeholder(attr)


class _Placeholder(metaclass=_PlaceholderMeta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("torchvision is a CPU import shim here; it cannot be used")

    def __class_getitem__(cls, item: Any) -> Any:
        return cls


def _placeholder(name: str) -> type:
    return _PlaceholderMeta(name, (_Placeholder,), {})


def _module_getattr(attr: str) -> Any:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _placeholder(attr)


class _ShimFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every ``torchvision.<sub>`` import with an empty placeholder package."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


if not any(isinstance(finder, _ShimFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _ShimFinder())


def __getattr__(attr: str) -> Any:
    return _module_getattr(attr)

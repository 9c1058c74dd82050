"""Python imports this at start-up from ``sys.path``: in every process with this directory on
``PYTHONPATH`` (those the SGLang launcher's scheduler starts), :mod:`smgd_unpinned` is applied
right after ``torch`` is first imported.

Only then: importing torch up front would make every such process hold it (~190 MiB RSS),
among them multiprocessing's resource tracker, which never uses torch.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps torch's own loader so the fallback follows its import."""

    def find_spec(
        self,
        name: str,
        path: object = None,
        target: object = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once: the lookup below must not find this finder again
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run_module(module)
            importlib.import_module("smgd_unpinned")  # installs on import (a sibling module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if "torch" in sys.modules:
    importlib.import_module("smgd_unpinned")
else:
    sys.meta_path.insert(0, _AfterTorch())

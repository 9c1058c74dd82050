"""Python imports this at start-up from ``sys.path``: every process with this directory on
``PYTHONPATH`` (those the SGLang launcher's scheduler starts) gets :mod:`smgd_unpinned`."""

import importlib

importlib.import_module("smgd_unpinned")  # installs on import (a sibling: not a package)

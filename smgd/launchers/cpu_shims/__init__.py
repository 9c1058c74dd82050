"""Import-only stand-ins that let SGLang's CPU engine import on a machine without a GPU.

This directory (not the package) goes on ``PYTHONPATH`` when asked, so ``sgl_kernel`` and
``torchvision`` resolve to the stand-ins below. PyPI has no CPU build of ``sgl_kernel`` and its
``torchvision`` wheels need a CUDA torch; a text-only Llama imports both but calls neither
(except the one op re-implemented in ``sgl_kernel``).
"""

"""Torch behaviour SGLang needs on a machine without an accelerator (``sitecustomize.py``).

This directory (not the package) goes on ``PYTHONPATH`` next to ``cpu_shims/`` when the SGLang
launcher runs with ``--cpu-shims``. It is kept apart from ``cpu_shims/`` because CI keys the
cached SGLang venv on the shims' files, and this changes nothing in the venv.
"""

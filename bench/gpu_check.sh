#!/usr/bin/env bash
# The prepared GPU check (issue 33): every GPU-relevant check of FedST in one go, report in $OUT.
#
#   make gpu-wheels                 # here, once: the wheels the GPU machine lacks, into .whl/
#   bash bench/gpu_check.sh         # on the GPU machine, from the repository root (about 6 min)
#   bash bench/gpu_check.sh --cpu   # anywhere: the same steps on the CPU at a reduced size
#
# Writes gpu_check.md, gpu_check.json and gpu_check.log to $OUT (default ./gpu_check_out) after
# every step. Python: $FEDST_PYTHON, else .venv/bin/python when present, else python3. When that
# python lacks FedST's dependencies and .whl/ holds wheels, they are installed into /tmp/site
# first (no index, no dependency resolution: .whl/ holds the whole closure). The steps and their
# sizes: bench/gpu_check.py; docs/paper-scale.md, "The GPU check".
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
out="${OUT:-./gpu_check_out}"
mkdir -p "$out" || exit 1
if [[ -n "${FEDST_PYTHON:-}" ]]; then
    python="$FEDST_PYTHON"
elif [[ -x .venv/bin/python ]]; then
    python=.venv/bin/python
else
    python=python3
fi
# find_spec locates the modules without importing them (seconds on a loaded machine)
needs="import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ['flwr', 'hydra', 'omegaconf', 'monai', 'albumentations', 'open_clip']))"
if ! "$python" -c "$needs" 2>/dev/null; then
    if ! compgen -G ".whl/*.whl" >/dev/null; then
        echo "gpu_check: $python lacks FedST's dependencies and .whl/ is empty; run make gpu-wheels where pip works and carry .whl" >&2
        exit 1
    fi
    site="${FEDST_WHEEL_SITE:-/tmp/site}"
    echo "gpu_check: installing $(ls .whl/*.whl | wc -l) wheels into $site" >&2
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || { echo "gpu_check: installing .whl/ into $site failed" >&2; exit 1; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    "$python" -c "import flwr, hydra, monai, albumentations, open_clip" || {
        echo "gpu_check: FedST's dependencies still do not import after installing .whl/" >&2; exit 1; }
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FLWR_TELEMETRY_ENABLED=0 PYTHONUNBUFFERED=1
exec "$python" -m bench.gpu_check run --out "$out" "$@"

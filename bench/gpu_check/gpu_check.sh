#!/usr/bin/env bash
# The prepared GPU check (issues 33, 43): every GPU-relevant check of FedST in one go, report in $OUT.
#
#   make gpu-wheels                 # here, once: the wheels the GPU machine lacks, into .whl/
#   bash bench/gpu_check/gpu_check.sh         # on the GPU machine, from the repository root (about 8 min;
#                                   # the device tool's timeout_s: 520, docs/paper-scale.md)
#   bash bench/gpu_check/gpu_check.sh --cpu   # anywhere: the same steps on the CPU at a reduced size
#   make gpu-rehearsal              # here: --cpu in an environment laid out as the GPU machine's
#
# In this order: a CUDA pre-flight (without --cpu; seconds, exit 3 with the reason), the wheels,
# pip_list.txt and requirements.txt (the packages as this python sees them, and their unmet
# requirements) written to $OUT, then the steps (bench/gpu_check/check.py), which rewrite gpu_check.md,
# gpu_check.json and gpu_check.log in $OUT (default ./gpu_check_out) after every step. Exits
# non-zero when any step did not end ok.
#
# Python: $FEDST_PYTHON, else .venv/bin/python when present, else python3. When that python lacks
# FedST's dependencies and $FEDST_WHEEL_DIR (default .whl/) holds wheels, they are installed into
# $FEDST_WHEEL_SITE (default /tmp/site) and put on PYTHONPATH (no index, no dependency
# resolution: the wheel folder holds the whole closure). Every child process inherits that
# PYTHONPATH: on the GPU machine it is the only way to FedST's dependencies.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
out="${OUT:-./gpu_check_out}"
mkdir -p "$out" || exit 1
if [[ -n "${FEDST_PYTHON:-}" ]]; then
    python="$FEDST_PYTHON"
elif [[ -x .venv/bin/python ]]; then
    python=.venv/bin/python
else
    python=python3
fi
device=cuda
for arg in "$@"; do [[ "$arg" == "--cpu" ]] && device=cpu; done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FLWR_TELEMETRY_ENABLED=0 PYTHONUNBUFFERED=1 \
    NO_ALBUMENTATIONS_UPDATE=1
# torch alone: a machine whose GPU torch cannot use stops here, in seconds, with the reason
"$python" -m bench.gpu_check preflight --device "$device" || exit 3
# find_spec locates the modules without importing them (seconds on a loaded machine)
needs="import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ['flwr', 'hydra', 'omegaconf', 'monai', 'albumentations', 'open_clip']))"
if ! "$python" -c "$needs" 2>/dev/null; then
    wheels="${FEDST_WHEEL_DIR:-.whl}"
    if ! compgen -G "$wheels/*.whl" >/dev/null; then
        echo "gpu_check: $python lacks FedST's dependencies and $wheels/ is empty; run make gpu-wheels where pip works and carry .whl" >&2
        exit 1
    fi
    site="${FEDST_WHEEL_SITE:-/tmp/site}"
    echo "gpu_check: installing $(ls "$wheels"/*.whl | wc -l) wheels into $site" >&2
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$wheels"/*.whl || { echo "gpu_check: installing $wheels/ into $site failed" >&2; exit 1; }
    export PYTHONPATH="$PWD:$site${PYTHONPATH#"$PWD"}"
    "$python" -c "import flwr, hydra, monai, albumentations, open_clip" || {
        echo "gpu_check: FedST's dependencies still do not import after installing $wheels/" >&2; exit 1; }
fi
# what this python sees (PYTHONPATH first), before any step can fail on it
"$python" -m pip list --format=freeze >"$out/pip_list.txt" 2>/dev/null
"$python" -m bench.gpu_check requirements >"$out/requirements.txt" 2>&1
if [[ -s "$out/requirements.txt" ]]; then
    echo "gpu_check: unmet or shadowed requirements (requirements.txt):" >&2
    head -20 "$out/requirements.txt" >&2
fi
exec "$python" -m bench.gpu_check run --out "$out" "$@"

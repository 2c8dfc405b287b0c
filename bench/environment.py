"""The environment a bench script gives the Python processes it starts."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) with the repository first on PYTHONPATH and what
    PYTHONPATH already held kept after it: on the GPU machine FedST's dependencies are reachable
    only through it (bench/gpu_check/gpu_check.sh installs them with ``pip --target``), so a child given
    the repository alone dies at its first ``import hydra``. Telemetry off."""
    environ = dict(os.environ if environ is None else environ)
    inherited = environ.get("PYTHONPATH", "")
    paths = [str(REPO), *(p for p in inherited.split(os.pathsep) if p and p != str(REPO))]
    return {**environ, "FLWR_TELEMETRY_ENABLED": "0", "PYTHONPATH": os.pathsep.join(paths)}

"""The GPU check rehearsed here, as the GPU machine will run it (issue 43).

    make gpu-rehearsal                                  # report in gpu_rehearsal_out/
    .venv/bin/python -m bench.gpu_check.rehearsal --out DIR   # the same, elsewhere

On the GPU machine ``python3`` holds torch and a long list of packages of its own
(bench/gpu_check/wheels.py, ``GPU_MACHINE_PACKAGES``); FedST's other dependencies arrive as wheels that
``bench/gpu_check/gpu_check.sh`` installs with ``pip install --target /tmp/site`` and reaches through
PYTHONPATH alone, and FedST itself is not installed (the repository is on PYTHONPATH). In
``.venv`` every package sits in site-packages, so ``bash bench/gpu_check/gpu_check.sh --cpu`` there cannot
show what only PYTHONPATH carries (a child process started with PYTHONPATH set to the repository
alone, say). This script lays out that machine's environment:

1. a bare virtual environment ``.rehearsal/venv`` (this machine's Python, pip, nothing else);
2. the machine's own packages, as far as FedST uses them: every distribution of ``.venv`` that the
   machine's package list names (torch, torchvision, numpy, timm, onnx, onnxruntime, opencv,
   pytest, PyYAML, ...), linked into ``.rehearsal/device-site`` and put on that environment's
   path by a ``.pth`` file, as the machine's site-packages are on its python's path. Their
   versions are ``.venv``'s (torch 2.14.1 here against 2.11.0 there: the machine's versions are
   not all installable here, and torch 2.11 would download several GB); the report says so;
3. the wheel plan computed for this Python (``wheel_plan(python="3.11")``, as ``make gpu-wheels``
   computes it for 3.12 there) downloaded into ``.rehearsal/whl`` (kept between runs);

then it runs ``bash bench/gpu_check/gpu_check.sh --cpu`` with ``FEDST_PYTHON`` set to that environment's
python and ``FEDST_WHEEL_DIR`` to the wheels, so the script installs them with ``pip --target``
and puts them on PYTHONPATH exactly as on the GPU machine. Exits with the check's status.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from bench.gpu_check.wheels import (
    CARRIED_ANYWAY,
    GPU_MACHINE_PACKAGES,
    GPU_MACHINE_VERSIONS,
    fetch_wheels,
    wheel_plan,
)

REPO = Path(__file__).resolve().parents[2]
REHEARSAL = REPO / ".rehearsal"
log = logging.getLogger("gpu_rehearsal")

OWN_TOOLS = frozenset({"pip", "setuptools", "wheel"})
"""The bare environment brings its own; linking .venv's too would shadow them."""


def machine_distributions(
    present: frozenset[str] = GPU_MACHINE_PACKAGES, carried: frozenset[str] = frozenset()
) -> dict[str, metadata.Distribution]:
    """The distributions of this environment that the GPU machine's python3 also has, and what
    they need here that the wheels (``carried``) do not bring: what the rehearsal's bare
    environment gets besides pip. The machine's packages meet their own needs there; ours may be
    newer and need more (huggingface-hub 2 needs httpx2, which the machine's 1.33 does not)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    installed = {canonicalize_name(d.metadata["Name"] or ""): d for d in metadata.distributions()}
    found: dict[str, metadata.Distribution] = {}
    todo = [name for name in installed if name in present]
    while todo:
        name = todo.pop()
        if name in found or name in OWN_TOOLS or name in carried or name not in installed:
            continue
        found[name] = installed[name]
        for text in installed[name].requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return found


def top_level_entries(dist: metadata.Distribution) -> set[str]:
    """The names directly under site-packages that ``dist`` installed (packages, modules,
    shared-library folders, its .dist-info), from its RECORD; scripts outside it are left."""
    entries = set()
    for path in dist.files or []:
        parts = Path(path).parts
        if parts and parts[0] != ".." and not parts[0].startswith("__pycache__"):
            entries.add(parts[0])
    return entries


def link_machine_site(dest: Path, dists: dict[str, metadata.Distribution]) -> list[str]:
    """Symbolic links in ``dest`` to the files of ``dists`` in this environment's site-packages
    (a namespace folder shared by several of them, ``nvidia/``, is linked once); returns
    "name version" of each."""
    site = Path(sysconfig.get_paths()["purelib"])
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for dist in dists.values():
        for entry in top_level_entries(dist):
            source = site / entry
            if source.exists() and not (dest / entry).exists():
                (dest / entry).symlink_to(source)
    return [f"{name} {dist.version}" for name, dist in sorted(dists.items())]


def make_environment(root: Path) -> Path:
    """``root/venv``: a bare virtual environment of this machine's base Python (pip only) whose
    path also holds ``root/device-site``; returns its python."""
    venv = root / "venv"
    if venv.exists():
        shutil.rmtree(venv)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "gpu_machine_packages.pth").write_text(f"{root / 'device-site'}\n")
    return python


def rehearse(out: Path, root: Path = REHEARSAL, extra: list[str] | None = None) -> int:
    """Lay out the environment in ``root``, run the check there with its report in ``out``;
    returns the check's exit status."""
    python_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    plan = wheel_plan(python=python_version)
    dists = machine_distributions(carried=frozenset(plan) - set(CARRIED_ANYWAY))
    linked = link_machine_site(root / "device-site", dists)
    python = make_environment(root)
    wheels = fetch_wheels(plan, root / "whl", python=python_version)
    site = root / "site"
    if site.exists():
        shutil.rmtree(site)  # installed afresh by gpu_check.sh, as on a new machine
    out.mkdir(parents=True, exist_ok=True)
    differs = {
        name: (GPU_MACHINE_VERSIONS[name], dist.version)
        for name, dist in dists.items()
        if name in GPU_MACHINE_VERSIONS and GPU_MACHINE_VERSIONS[name] != dist.version
    }
    (out / "rehearsal.md").write_text(
        "\n".join(
            [
                "# The environment of this rehearsal",
                "",
                f"Python {platform.python_version()} (the GPU machine: 3.12.3), {python}",
                "",
                f"The machine's packages ({len(linked)}, linked from .venv): {', '.join(linked)}",
                "",
                "Versions that differ from the machine's recorded ones (machine, here): "
                + (", ".join(f"{n} {a} / {b}" for n, (a, b) in sorted(differs.items())) or "none"),
                "",
                f"Carried as wheels ({len(wheels)}, for CPython {python_version}): "
                + ", ".join(p.name for p in wheels),
                "",
            ]
        )
    )
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "FEDST_TEST_DEVICE")
    }
    env |= {
        "FEDST_PYTHON": str(python),
        "FEDST_WHEEL_DIR": str(root / "whl"),
        "FEDST_WHEEL_SITE": str(site),
        "OUT": str(out),
        "OMP_NUM_THREADS": "1",
        "PATH": os.pathsep.join(
            p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(sys.prefix)
        ),
    }
    log.info("running bash bench/gpu_check/gpu_check.sh --cpu with %s; report in %s", python, out)
    done = subprocess.run(
        ["bash", "bench/gpu_check/gpu_check.sh", "--cpu", *(extra or [])], cwd=REPO, env=env
    )
    shutil.rmtree(site, ignore_errors=True)
    return done.returncode


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n", 1)[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=REPO / "gpu_rehearsal_out")
    parser.add_argument("--root", type=Path, default=REHEARSAL, help="the environment's folder")
    args, check_args = parser.parse_known_args(argv)  # the rest goes to gpu_check.sh
    status = rehearse(args.out.resolve(), args.root.resolve(), check_args)
    print(f"gpu rehearsal: exit {status}; report {args.out / 'gpu_check.md'}")
    return status


if __name__ == "__main__":
    sys.exit(main())

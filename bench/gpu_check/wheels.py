"""The GPU machine's Python and packages, and the wheels FedST's dependencies travel there as
(``make gpu-wheels``; bench/gpu_check/gpu_check.sh installs them with ``pip --target`` on PYTHONPATH):
the download plan, the requirements the machine's versions must meet, and the size a device call
carries. Split from bench/gpu_check/check.py (issue 48), whose ``wheels`` and ``requirements``
subcommands call it.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
log = logging.getLogger("gpu_check")


# -- the GPU machine and its wheels --------------------------------------------------------------

GPU_MACHINE_PYTHON = "3.12"
"""The GPU machine's python3 (3.12.3; /work/.library/device/KINDS.md, read 2026-11)."""

GPU_MACHINE_PLATFORMS = (
    *(f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)),
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
"""Wheel platform tags its pip accepts (x86-64 glibc Linux); pip matches each tag exactly."""

GPU_MACHINE_PACKAGES = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
    diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
    hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
    jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
    lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx
    ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
    nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
    nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
    pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf
    psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
    pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
    scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
    shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
    tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz
    torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
    treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug
    wheel wrapt xarray xxhash yarl zipp""".split()  # noqa: SIM905
)
"""The packages its image holds (KINDS.md, "Python packages already there", read 2026-11-17)."""

GPU_MACHINE_VERSIONS = {
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "onnx": "1.23.1",
    "onnxruntime": "1.30.0",
    "onnxscript": "0.7.2",
    "safetensors": "0.8.0",
    "tokenizers": "0.23.2",
    "torch": "2.11.0",
    "torchvision": "0.26.0",
    "transformers": "5.17.0",
    "triton": "3.6.0",
}
"""The versions of the machine's packages that have been read there (KINDS.md's pip list row,
2026-11); the others are unknown until the check's ``pip_list.txt`` comes back."""

CARRIED_ANYWAY = {
    "protobuf": "flwr's generated code needs protobuf >= 5.29 and grpcio-health-checking's >= "
    "6.33.5; the machine's version is not recorded",
    "typing-extensions": "the carried pydantic 2.14 (albumentations) needs >= 4.16.0; the "
    "machine's version is not recorded, and a newer one serves its older users too",
}
"""Packages the machine has that travel anyway, in our version, and why."""

TRAVEL_LIMIT_BYTES = 64 * 1024**2
"""The working tree plus the wheels: what one device call may carry."""

WHEEL_DIR = REPO / ".whl"


def _environment(extra: str = "", python: str = GPU_MACHINE_PYTHON) -> dict[str, str]:
    """Marker environment of the GPU machine's python3, or of another CPython ``python``
    ("3.11": the rehearsal's), for requirement markers."""
    return {
        "python_version": python,
        "python_full_version": f"{python}.0" if python != GPU_MACHINE_PYTHON else "3.12.3",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": extra,
    }


def wheel_plan(
    roots: list[str] | None = None,
    present: frozenset[str] = GPU_MACHINE_PACKAGES,
    python: str = GPU_MACHINE_PYTHON,
) -> dict[str, str]:
    """name -> version (this environment's) of every distribution the GPU machine needs and
    lacks: the closure of fedst's requirements (``roots``, default fedst's own, without extras),
    descending only into packages the machine lacks (its own packages bring their own needs),
    extras of a requirement included, plus :data:`CARRIED_ANYWAY`; markers evaluated for
    CPython ``python`` (the machine's, or the rehearsal's). Raises when a needed package is not
    installed here."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    if roots is None:
        roots = [r for r in metadata.requires("fedst") or [] if "extra ==" not in r]
    plan: dict[str, str] = {}
    todo = [Requirement(r) for r in roots]
    expanded: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate(_environment(python=python)):
            continue
        name = canonicalize_name(req.name)
        if name in present or (name, frozenset(req.extras)) in expanded:
            continue
        expanded.add((name, frozenset(req.extras)))
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError as err:
            raise SystemExit(
                f"gpu-wheels: {req.name} is needed on the GPU machine but not installed here; "
                "run make venv first"
            ) from err
        plan[name] = dist.version
        for text in dist.requires or []:
            sub = Requirement(text)
            wanted = ["", *sorted(req.extras)]
            if sub.marker is None or any(
                sub.marker.evaluate(_environment(e, python)) for e in wanted
            ):
                sub.marker = None
                todo.append(sub)
    for name in CARRIED_ANYWAY:
        plan[name] = metadata.version(name)
    return dict(sorted(plan.items()))


def _wheel_key(path: Path) -> tuple[str, str] | None:
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    try:
        name, version, _, _ = parse_wheel_filename(path.name)
    except InvalidWheelFilename:
        return None
    return str(name), str(version)


def fetch_wheels(
    plan: dict[str, str], dest: Path = WHEEL_DIR, python: str = GPU_MACHINE_PYTHON
) -> list[Path]:
    """Download each planned wheel for CPython ``python`` on manylinux x86-64 (the GPU
    machine's, or the rehearsal's) into ``dest`` (kept when already there); a pure-Python
    package published only as a source archive is built into a ``none-any`` wheel here. Files of
    other versions or packages are removed: two versions stop the install."""
    dest.mkdir(parents=True, exist_ok=True)
    have = {_wheel_key(p): p for p in dest.glob("*.whl")}
    platforms = [arg for tag in GPU_MACHINE_PLATFORMS for arg in ("--platform", tag)]
    for name, version in plan.items():
        if (name, version) in have:
            continue
        download = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            python,
            "--implementation",
            "cp",
            *platforms,
            "-d",
            str(dest),
            f"{name}=={version}",
        ]
        if subprocess.run(download, check=False).returncode == 0:
            continue
        log.info("%s==%s has no wheel for the GPU machine: building it here", name, version)
        with tempfile.TemporaryDirectory() as tmp:
            build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", tmp]
            subprocess.run([*build, f"{name}=={version}"], check=True)
            (built,) = Path(tmp).glob("*.whl")
            if not built.name.endswith("-none-any.whl"):
                raise SystemExit(
                    f"gpu-wheels: {name}=={version} has no wheel for CPython "
                    f"{python} manylinux x86-64 and builds only a platform wheel "
                    f"({built.name}); pin a version with one in pyproject.toml"
                )
            shutil.move(built, dest / built.name)
    kept = []
    for path in sorted(dest.iterdir()):
        key = _wheel_key(path)
        if key is None or key[0] not in plan or plan[key[0]] != key[1]:
            path.unlink()
        else:
            kept.append(path)
    missing = set(plan) - {_wheel_key(p)[0] for p in kept}  # type: ignore[index]
    if missing:
        raise SystemExit(f"gpu-wheels: no wheel ended up in {dest} for {sorted(missing)}")
    return kept


def incompatible_wheels(wheels: list[Path]) -> list[str]:
    """The wheels among ``wheels`` that CPython :data:`GPU_MACHINE_PYTHON` on manylinux x86-64
    (:data:`GPU_MACHINE_PLATFORMS`) cannot install (pip does not check a local file's tags
    against ``--platform``, so this does)."""
    from packaging import tags
    from packaging.utils import parse_wheel_filename

    version = tuple(int(v) for v in GPU_MACHINE_PYTHON.split("."))
    supported = set(tags.cpython_tags(version, platforms=list(GPU_MACHINE_PLATFORMS)))
    supported |= set(
        tags.compatible_tags(
            version, "cp" + "".join(map(str, version)), platforms=list(GPU_MACHINE_PLATFORMS)
        )
    )
    return [p.name for p in wheels if not (parse_wheel_filename(p.name)[3] & supported)]


def unmet_on_the_gpu_machine(
    plan: dict[str, str], known: dict[str, str] = GPU_MACHINE_VERSIONS
) -> tuple[list[str], list[str]]:
    """The requirements of the planned (carried) packages on packages the machine has, checked
    against the machine's versions: (unmet, unknown). Unmet: the machine's recorded version does
    not satisfy it, so the carried package would fail at import there (e.g. a carried pydantic
    that needs a newer typing-extensions). Unknown: the machine's version was never read."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    unmet, unknown = [], []
    for name in plan:
        for text in metadata.requires(name) or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(_environment()):
                continue
            needed = canonicalize_name(req.name)
            if needed in plan or needed not in GPU_MACHINE_PACKAGES or not req.specifier:
                continue
            have = known.get(needed)
            if have is None:
                unknown.append(f"{name} needs {req.name}{req.specifier} (machine's: unknown)")
            elif not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{name} needs {req.name}{req.specifier}, the machine has {have}")
    return sorted(unmet), sorted(set(unknown))


def requirement_report() -> list[str]:
    """Every installed distribution (as this interpreter's sys.path finds it, PYTHONPATH first)
    whose requirements are not met by what is installed: one line each, empty when all are met.
    Lines of distributions shadowed by an earlier one on the path start with "shadowed"."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    first: dict[str, metadata.Distribution] = {}
    lines = []
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"] or "")
        if name in first:
            lines.append(
                f"shadowed: {name} {dist.version} at {dist.locate_file('')} "
                f"(in use: {first[name].version})"
            )
            continue
        first[name] = dist
    versions = {name: dist.version for name, dist in first.items()}
    for name, dist in sorted(first.items()):
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            have = versions.get(canonicalize_name(req.name))
            if have is None:
                lines.append(f"{name} {dist.version}: needs {req}, not installed")
            elif req.specifier and not req.specifier.contains(have, prereleases=True):
                lines.append(f"{name} {dist.version}: needs {req}, installed {have}")
    return lines


def travelling_bytes(repo: Path = REPO) -> int:
    """Bytes of the working tree that travels to the device machine: tracked files and untracked
    files git does not ignore (``git ls-files --cached --others --exclude-standard``)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout
    paths = {repo / p for p in listed.decode().split("\0") if p}
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def make_wheels() -> None:
    """``make gpu-wheels``: fill .whl/ and check the travel limit."""
    plan = wheel_plan()
    log.info("wheels for the GPU machine: %s", ", ".join(f"{n}=={v}" for n, v in plan.items()))
    wheels = fetch_wheels(plan)
    wrong = incompatible_wheels(wheels)
    if wrong:
        raise SystemExit(f"gpu-wheels: not installable by the GPU machine's python3: {wrong}")
    unmet, unknown = unmet_on_the_gpu_machine(plan)
    for line in unknown:
        log.info("not checkable here: %s", line)
    if unmet:
        raise SystemExit(
            "gpu-wheels: carried packages need newer versions than the GPU machine has (carry "
            "those too, or pin older packages): " + "; ".join(unmet)
        )
    wheel_bytes = sum(p.stat().st_size for p in wheels)
    tree = travelling_bytes()
    mib = 1024**2
    print(
        f"{len(wheels)} wheels in {WHEEL_DIR.relative_to(REPO)}/: {wheel_bytes / mib:.1f} MiB; "
        f"working tree {tree / mib:.1f} MiB; together {(wheel_bytes + tree) / mib:.1f} MiB "
        f"(limit {TRAVEL_LIMIT_BYTES / mib:.0f} MiB)"
    )
    if wheel_bytes + tree > TRAVEL_LIMIT_BYTES:
        largest = sorted(wheels, key=lambda p: p.stat().st_size, reverse=True)[:5]
        raise SystemExit(
            "gpu-wheels: the wheels and the working tree exceed the 64 MiB a device call carries; "
            f"largest wheels: {', '.join(p.name for p in largest)}"
        )

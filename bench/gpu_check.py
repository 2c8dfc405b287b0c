"""The prepared GPU check (issue 33, item 9): every GPU-relevant check of FedST in one command, on
a borrowed machine with one H100 (or H200), 16 cores, no network and a ``python3`` that already
holds torch 2.11, timm, onnx, onnxruntime, OpenCV, matplotlib, TensorBoard and pytest.

    make gpu-wheels                 # here: the wheels that machine lacks, into .whl/ (git-ignored)
    bash bench/gpu_check.sh         # there, from the repository root: report in $OUT or gpu_check_out/
    bash bench/gpu_check.sh --cpu   # anywhere: the same steps on the CPU at a reduced size

Steps, in this order, each with its own time limit inside one overall budget (``--budget-s``,
460 s on a GPU): ``facts`` (torch, CUDA, card, dtype, TF32, package versions); ``federation`` (a
tiny federation on the device with ``train_fed.py``, then ``eval_outfed.py`` and ``fedst.infer``,
checking that the device was really used); ``paper_scale`` (``bench.paper_scale --tiny-data`` at
512x640 with paper.yaml's settings: ms per site step, GPU busy fraction, SERQ's, the loader
wait's and the evaluation's shares, peak memory, the paper's run in hours); ``step`` (one training
step of the network, batch 2 of 4-frame clips at 512x640, with none of the options against TF32,
bf16, channels_last and torch.compile, in one process, so the ratios come from one run);
``stream`` (streaming inference FPS at 512x640: eager fp32, bf16 and fp16 autocast, compiled, and
ONNX Runtime with its CUDA provider where present); ``tests`` (the CUDA-relevant test files with
``FEDST_TEST_DEVICE=cuda``); with ``--cpu`` only (they do not fit the GPU lease, see
``GPU_SIZES``): ``paper_scale_baseline`` (fp32, no TF32, no compile, no channels_last) and
``paper_scale_options`` (``train.compile`` and ``train.channels_last`` on).

After every step ``gpu_check.md`` and ``gpu_check.json`` are rewritten and every command's output
is appended to ``gpu_check.log``, so a run cut off at any point still returns what it measured.
A step whose override names a config field this checkout does not have is ``unsupported``.

``--cpu`` runs the same steps on the CPU: 64x80 instead of 512x640, 1 round of 1 iteration, a
few timed iterations, torch.compile with the ``eager`` backend (dynamo's tracing without
inductor's C++ build, which takes minutes on 2 cores) and only test_devices.py and this check's
own device tests, so tests/test_gpu_check.py can run the script in CI-sized time.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean, median

from bench.environment import child_environment
from bench.scratch import scratch_dir

REPO = Path(__file__).resolve().parents[1]
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


# -- device facts -------------------------------------------------------------------------------


def device_facts(device_name: str) -> dict[str, object]:
    """Python, torch, CUDA, the card, its bf16 support, TF32 flags as the runs set them, the
    packages that matter here and ONNX Runtime's providers."""
    from importlib import metadata

    import torch

    from fedst import accel

    device = torch.device(device_name)
    facts: dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": str(device),
        "card": accel.device_name(device),
        "cpu_cores": os.cpu_count(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        accel.configure_device(device, tf32=True, cudnn_benchmark=True)
        facts |= {
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "memory_gib": props.total_memory / 1024**3,
            "bf16_supported": torch.cuda.is_bf16_supported(),
            "cudnn": torch.backends.cudnn.version(),
            "tf32_after_configure_device": {
                "matmul_fp32_precision": torch.backends.cuda.matmul.fp32_precision,
                "conv_fp32_precision": torch.backends.cudnn.conv.fp32_precision,
            },
        }
        smi = shutil.which("nvidia-smi")
        if smi:
            query = [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"]
            facts["nvidia_smi"] = subprocess.run(
                query, capture_output=True, text=True, check=False
            ).stdout.strip()
    versions = {}
    for name in ("flwr", "monai", "hydra-core", "timm", "numpy", "protobuf", "onnxruntime"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    facts["packages"] = versions
    started = time.perf_counter()  # a fresh machine builds matplotlib's font cache once (~17 s
    import matplotlib.font_manager  # noqa: F401  on the H200): here, not inside a timed step

    facts["matplotlib_import_s"] = round(time.perf_counter() - started, 1)
    import importlib.util

    facts["imported_from"] = {  # where each comes from: /tmp/site's wheels, or the machine's own
        name: str(Path(spec.origin).parent.parent)
        for name in ("torch", "numpy", "flwr", "hydra", "monai")
        if (spec := importlib.util.find_spec(name)) is not None and spec.origin
    }
    try:
        import onnxruntime

        facts["onnxruntime_providers"] = onnxruntime.get_available_providers()
    except ImportError:
        facts["onnxruntime_providers"] = []
    return facts


def preflight(device_name: str) -> str | None:
    """Why the check cannot run on ``device_name`` (None: it can): on "cuda", a torch that sees
    no GPU (fedst.accel.cuda_unavailable_reason: a CPU-only build, hidden GPUs, a driver too
    old) or that cannot run one kernel on it. Seconds, before any wheel is installed."""
    import torch

    from fedst.accel import cuda_unavailable_reason

    if device_name != "cuda":
        return None
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no GPU: {cuda_unavailable_reason()}"
    try:
        value = (torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")).sum()
        if float(value) != 64.0**3:
            return f"a 64x64 matrix product on {torch.cuda.get_device_name()} gave {float(value)}"
    except RuntimeError as err:
        return f"torch {torch.__version__} cannot run a kernel on the GPU: {err}"
    return None


# -- step: one training step with and without the options ---------------------------------------


@dataclass(frozen=True)
class StepVariant:
    """One way to run the training step: autocast dtype (None: fp32), TF32, channels_last and
    torch.compile's mode (None: eager)."""

    name: str
    dtype: str | None = None
    tf32: bool = False
    channels_last: bool = False
    compile_mode: str | None = None


STEP_VARIANTS = (
    StepVariant("baseline: fp32, no TF32, eager, contiguous"),
    StepVariant("TF32", tf32=True),
    StepVariant("bf16 autocast + TF32", dtype="bf16", tf32=True),
    StepVariant("bf16 + channels_last", dtype="bf16", tf32=True, channels_last=True),
    StepVariant("bf16 + compile default", dtype="bf16", tf32=True, compile_mode="default"),
    StepVariant(
        "bf16 + channels_last + compile reduce-overhead",
        dtype="bf16",
        tf32=True,
        channels_last=True,
        compile_mode="reduce-overhead",
    ),
)
"""The baseline first: every ratio in the report is against it, measured in the same process."""

_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _set_tf32(device, enabled: bool) -> None:
    """TF32 on or off through fedst.accel.set_tf32, which sets PyTorch's legacy and new switches
    alike: the new ones alone make torch.compile raise "mix of the legacy and new APIs" on
    some torch versions (2.10; the GPU machine has 2.11)."""
    from fedst.accel import set_tf32

    if device.type == "cuda":
        set_tf32(enabled)


def _autocast(device, dtype: str | None):
    import torch

    if dtype is None or device.type != "cuda":
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=getattr(torch, _DTYPES[dtype]))


def _write_json(path: Path | None, payload: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(payload, indent=1, default=str))


def bench_step(
    device_name: str,
    size: tuple[int, int],
    iters: int,
    repeats: int,
    budget_s: float,
    compile_backend: str,
    out: Path | None,
) -> dict:
    """ms per training step (batch 2 of 4-frame clips, AdamW, Eq. 9 loss) of each
    :data:`STEP_VARIANTS`: each warmed up (3 steps: compiling) and timed ``repeats`` times over
    ``iters`` steps, then all timed again round-robin ``repeats`` times while 80 % of
    ``budget_s`` lasts (the minimum of the means counts). Results go to ``out`` after every
    measurement."""
    import torch

    from fedst import accel
    from fedst.model.losses import SegmentationLoss
    from fedst.model.network import NetworkConfig, build_network

    started = time.monotonic()
    device = torch.device(device_name)
    torch.manual_seed(0)
    template = build_network(NetworkConfig())
    indicator = torch.nn.functional.normalize(torch.randn(template.cfg.indicator_dim), dim=0)
    indicator = indicator.to(device)
    clips = torch.randn(2, template.cfg.num_frames, 3, *size, device=device)
    target = torch.randint(0, template.cfg.num_classes, (2, *size), device=device)
    loss_fn = SegmentationLoss(num_classes=template.cfg.num_classes)
    result: dict = {"device": str(device), "size": list(size), "batch": 2, "variants": {}}
    result["compile_backend"] = compile_backend  # eager (--cpu): dynamo's tracing, no codegen
    if device.type != "cuda":
        result["note"] = "CPU: autocast and TF32 are CUDA-only, so every variant runs in fp32"
    steps: dict[str, Callable[[], None]] = {}
    for variant in STEP_VARIANTS:
        if time.monotonic() - started > budget_s * 0.6:
            result["variants"][variant.name] = {"status": "not run: time budget"}
            continue
        net = copy.deepcopy(template).to(device).train()
        batch = clips
        if variant.channels_last:
            net = net.to(memory_format=torch.channels_last)
            # every frame [3, H, W] channels-last (as fedst.accel.clips_channels_last)
            frames = clips.flatten(0, 1).contiguous(memory_format=torch.channels_last)
            batch = frames.unflatten(0, clips.shape[:2])
        optimizer = torch.optim.AdamW(
            net.parameters(), lr=6e-5, **accel.fused_optimizer_options(device)
        )
        if variant.compile_mode is not None:
            if compile_backend == "inductor":
                net.compile(mode=variant.compile_mode)
            else:
                net.compile(backend=compile_backend)

        def step(net=net, batch=batch, optimizer=optimizer, variant=variant) -> None:
            _set_tf32(device, variant.tf32)
            optimizer.zero_grad(set_to_none=True)
            with _autocast(device, variant.dtype):
                logits = net(batch, indicator)
            loss_fn(logits.float(), target).backward()
            optimizer.step()

        warm = time.monotonic()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            for _ in range(3):
                step()
            _sync(device)
        except Exception as err:  # a variant that cannot run is a result, not the end
            result["variants"][variant.name] = {"status": f"failed: {type(err).__name__}: {err}"}
            _write_json(out, result)
            continue
        entry = {
            "status": "ok",
            "warmup_seconds": time.monotonic() - warm,
            **dataclasses.asdict(variant),
        }
        if device.type == "cuda":
            entry["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 1024**3
        result["variants"][variant.name] = entry
        steps[variant.name] = step
        _write_json(out, result)
    # each variant is timed as soon as it is warm (a cut-off run keeps those figures), then all
    # again round-robin (the same machine state for each); the minimum mean of each counts
    for name in steps:
        _time_variant(result, name, steps[name], iters, repeats, device, out)
    for _ in range(repeats):
        if time.monotonic() - started > budget_s * 0.8:
            break
        for name in steps:
            _time_variant(result, name, steps[name], iters, 1, device, out)
    return result


def _time_variant(
    result: dict, name: str, step: Callable[[], None], iters: int, repeats: int, device, out
) -> None:
    """Time ``step`` ``repeats`` x ``iters`` times; keep the lowest mean ms in the result with
    the speed-up over the baseline, and write the result."""
    best = result["variants"][name].get("ms_per_step", float("inf"))
    for _ in range(repeats):
        _sync(device)
        begin = time.perf_counter()
        for _ in range(iters):
            step()
        _sync(device)
        best = min(best, (time.perf_counter() - begin) * 1e3 / iters)
    result["variants"][name]["ms_per_step"] = best
    baseline = result["variants"].get(STEP_VARIANTS[0].name, {}).get("ms_per_step")
    for entry in result["variants"].values():
        if baseline and "ms_per_step" in entry:
            entry["speedup_vs_baseline"] = baseline / entry["ms_per_step"]
    _write_json(out, result)


# -- stream: streaming inference FPS ------------------------------------------------------------


def _compile_streaming(net, backend: str, mode: str) -> None:
    """torch.compile the modules a streaming step calls (encoder, temporal modules, channel
    selection, prompts, decoder), in place, so ``StreamingState`` runs them compiled."""
    modules = [net.encoder, net.decoder, *net.temporal.values()]
    modules += [*net.channel_selection.values(), *net.prompt.values()]
    for module in modules:
        if backend == "inductor":
            module.compile(mode=mode)
        else:
            module.compile(backend=backend)


COMPARED_FRAMES = 8
"""Frames whose logits every streaming variant compares with eager fp32's."""


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def frame_time_summary(seconds: list[float]) -> dict[str, float]:
    """ms per frame at the median (p50) and 95th percentile (p95) and the FPS of each: the
    median alone hides the slow frames a viewer sees as stutter."""
    p50, p95 = median(seconds), _quantile(seconds, 0.95)
    return {"ms_p50": p50 * 1e3, "ms_p95": p95 * 1e3, "fps": 1 / p50, "fps_p95": 1 / p95}


def bench_stream(
    device_name: str,
    size: tuple[int, int],
    frames: int,
    budget_s: float,
    compile_backend: str,
    out: Path | None,
) -> dict:
    """Frames per second of FedST streaming (one encoder pass per frame, earlier frames'
    features cached; ``FedSTNet.stream``) at ``size``, batch 1, a host sync after every frame
    (a viewer needs each frame's logits), p50 and p95 per frame: eager fp32, bf16 and fp16
    autocast, compiled (fp32 and bf16), compiled with CUDA graphs (``reduce-overhead``, bf16),
    and ONNX Runtime (on a GPU only with its CUDA provider; the CPU provider with ``--cpu``).
    Each variant's logits of the first :data:`COMPARED_FRAMES` frames are compared with eager
    fp32's (``max_abs_diff_vs_eager_fp32``): a fast variant with wrong output shows."""
    import torch

    from fedst.model.network import NetworkConfig, build_network

    started = time.monotonic()
    device = torch.device(device_name)
    torch.manual_seed(0)
    net = build_network(NetworkConfig()).eval().to(device)
    indicator = torch.nn.functional.normalize(torch.randn(net.cfg.indicator_dim), dim=0).to(device)
    video = torch.randn(8, 1, 3, *size, device=device)
    result: dict = {"device": str(device), "size": list(size), "frames": frames, "variants": {}}
    interval_s, fps_of_video = 0.2, 25.0
    reference: list = []

    def run(name: str, stream_net, dtype: str | None, warmup: int, graphs: bool = False) -> None:
        if time.monotonic() - started > budget_s * 0.7:
            result["variants"][name] = {"status": "not run: time budget"}
            _write_json(out, result)
            return
        try:
            logits, times = [], []
            with torch.no_grad(), _autocast(device, dtype):
                # the compared frames first, from a fresh stream (the same history as eager's)
                for repeat in range(2):
                    state = stream_net.stream(indicator, interval_s=interval_s)
                    for index in range(COMPARED_FRAMES if repeat == 0 else warmup + frames):
                        if graphs:
                            torch.compiler.cudagraph_mark_step_begin()
                        begin = time.perf_counter()
                        output = state.step(video[index % len(video)], index / fps_of_video)
                        _sync(device)
                        if repeat == 0:
                            logits.append(output.float().cpu())
                        else:
                            times.append(time.perf_counter() - begin)
            entry = {"status": "ok", **frame_time_summary(times[warmup:])}
            entry["first_frames_seconds"] = sum(times[:warmup])
            if not reference:
                reference.extend(logits)
            entry["max_abs_diff_vs_eager_fp32"] = max(
                float((a - b).abs().max()) for a, b in zip(logits, reference, strict=True)
            )
            result["variants"][name] = entry
        except Exception as err:
            result["variants"][name] = {"status": f"failed: {type(err).__name__}: {err}"}
        _write_json(out, result)

    _set_tf32(device, False)
    run("eager fp32", net, None, warmup=4)  # the reference: fp32 without TF32
    _set_tf32(device, True)
    if device.type == "cuda":
        run("eager fp32 + TF32", net, None, warmup=4)
        run("eager bf16 autocast", net, "bf16", warmup=4)
        run("eager fp16 autocast", net, "fp16", warmup=4)
    compiled = copy.deepcopy(net)
    _compile_streaming(compiled, compile_backend, "default")
    run(f"compiled fp32 ({compile_backend})", compiled, None, warmup=8)
    if device.type == "cuda":
        run(f"compiled bf16 ({compile_backend})", compiled, "bf16", warmup=8)
        graphed = copy.deepcopy(net)
        _compile_streaming(graphed, compile_backend, "reduce-overhead")
        run("CUDA graphs bf16 (reduce-overhead)", graphed, "bf16", warmup=8, graphs=True)
    else:
        result["variants"]["CUDA graphs (reduce-overhead)"] = {"status": "skipped: needs CUDA"}
    _bench_onnx(net.cpu(), indicator.cpu(), size, frames, device, result, out)
    return result


def _bench_onnx(net, indicator, size, frames, device, result: dict, out: Path | None) -> None:
    """ONNX Runtime streaming of ``fedst.export``'s graph: on a GPU with its CUDA provider only
    (the CPU provider there would time the 16 host cores, not the card); on the CPU with the CPU
    provider."""
    name = "ONNX Runtime"
    try:
        import numpy as np
        import onnxruntime as ort

        from fedst.export import OnnxStreamer, export_onnx

        available = ort.get_available_providers()
        if device.type == "cuda" and "CUDAExecutionProvider" not in available:
            result["variants"][name] = {
                "status": f"skipped: this onnxruntime has no CUDAExecutionProvider ({available})"
            }
            _write_json(out, result)
            return
        provider = "CUDAExecutionProvider" if device.type == "cuda" else "CPUExecutionProvider"
        name = f"ONNX Runtime {provider}"
        with tempfile.TemporaryDirectory() as tmp:
            path = export_onnx(net, indicator, size, 0.2, Path(tmp) / "fedst.onnx")
            streamer = OnnxStreamer(path)
            # OnnxStreamer builds a CPU session; the same graph on the chosen provider
            streamer.session = ort.InferenceSession(str(path), providers=[provider])
            frame = np.random.default_rng(0).standard_normal((1, 3, *size), dtype=np.float32)
            times = []
            for index in range(4 + frames):
                begin = time.perf_counter()
                streamer.step(frame, index / 25.0)
                times.append(time.perf_counter() - begin)
        result["variants"][name] = {
            "status": "ok",
            **frame_time_summary(times[4:]),
            "providers_available": available,
        }
    except Exception as err:
        result["variants"][name] = {"status": f"failed: {type(err).__name__}: {err}"}
    _write_json(out, result)


# -- federation: the device was really used -----------------------------------------------------


def check_federation(run_dir: Path, infer_dir: Path, device: str) -> dict:
    """Evidence that a finished tiny federation ran on ``device``: its config.json asks for it,
    and on CUDA its train.jsonl reports CUDA memory (a ``cuda`` / ``gpu`` key > 0);
    eval_outfed.py wrote its out-of-federation scores and fedst.infer its summary. Raises
    :class:`CheckFailed`."""
    config = json.loads((run_dir / "config.json").read_text())
    requested = config["train"]["device"]
    if requested != device:
        raise CheckFailed(f"{run_dir}/config.json: train.device={requested!r}, not {device!r}")
    rows = [json.loads(line) for line in (run_dir / "train.jsonl").read_text().splitlines()]
    cuda_bytes = max(
        (
            v
            for row in rows
            for k, v in row.items()
            if ("cuda" in k or "gpu" in k) and isinstance(v, int | float)
        ),
        default=0,
    )
    if device == "cuda" and not cuda_bytes > 0:
        raise CheckFailed(f"{run_dir}/train.jsonl: no CUDA memory reported (a CPU run?)")
    final = json.loads((run_dir / "final.json").read_text())
    if not final.get("out_of_federation"):
        raise CheckFailed(f"{run_dir}/final.json: eval_outfed.py wrote no out_of_federation")
    summary = json.loads((infer_dir / "summary.json").read_text())
    if summary["frames"] < 1:
        raise CheckFailed(f"{infer_dir}/summary.json: fedst.infer streamed no frame")
    return {
        "train.device": requested,
        "max_cuda_bytes_in_train_jsonl": cuda_bytes,
        "rounds": max(r.get("round", 0) for r in rows),
        "infer_frames": summary["frames"],
        "infer_fps_network_mean": summary["fps_network_mean"],
    }


# -- the driver ---------------------------------------------------------------------------------


class CheckFailed(RuntimeError):
    """A step ran but what it produced does not show what it should."""


@dataclass
class Step:
    """One step of the check: commands run in order (each must exit 0), then ``collect`` reads
    their outputs into the report's metrics (or raises :class:`CheckFailed`)."""

    name: str
    title: str
    timeout_s: float
    commands: list[list[str] | Callable[[], list[str]]]
    """argv lists, or functions that make one when its turn comes (from an earlier one's files)"""
    collect: Callable[[], dict] = dict
    env: dict[str, str] = field(default_factory=dict)
    unsupported: str | None = None
    """Why the step cannot run in this checkout (a config field it overrides is missing)."""
    measures: str = ""
    """What the step's figures measure and over what window (the report prints it)."""


@dataclass
class StepResult:
    name: str
    title: str
    status: str
    """ok | failed | timeout | unsupported | not run"""
    seconds: float = 0.0
    commands: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    note: str = ""
    gpu: dict = field(default_factory=dict)
    measures: str = ""


class GpuWatch:
    """nvidia-smi's utilisation and memory used every 100 ms during one step (no-op without it)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.samples: list[tuple[float, float]] = []
        self._process: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            parts = [p.strip() for p in line.split(",")]
            with contextlib.suppress(ValueError):
                self.samples.append((float(parts[0]), float(parts[1])))

    def __enter__(self) -> GpuWatch:
        if self.enabled:
            self._process = subprocess.Popen(
                [
                    "nvidia-smi",
                    "--query-gpu=utilization.gpu,memory.used",
                    "--format=csv,noheader,nounits",
                    "-lms=100",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait()
            assert self._thread is not None
            self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        return {
            "utilization_mean_pct": mean(u for u, _ in self.samples),
            "memory_used_max_mib": max(m for _, m in self.samples),
            "samples": len(self.samples),
        }


def _run_command(command: list[str], env: dict[str, str], timeout_s: float, logfile) -> int:
    """Run ``command`` in its own process group, output appended to ``logfile``; on timeout the
    whole group (loader workers included) is killed and -1 returned."""
    logfile.write(f"\n$ {' '.join(command)}\n")
    logfile.flush()
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=logfile,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        return process.wait(timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        logfile.write(f"\n[gpu_check] killed after {timeout_s:.0f} s\n")
        return -1


def run_step(step: Step, env: dict[str, str], timeout_s: float, gpu: bool, logfile) -> StepResult:
    """Run one step within ``timeout_s`` and collect its result (partial metrics even after a
    timeout or a failed command, where its files exist)."""
    result = StepResult(step.name, step.title, "ok", measures=step.measures)
    if step.unsupported:
        result.status, result.note = "unsupported", step.unsupported
        return result
    if timeout_s < 5:
        result.status, result.note = "not run", "the overall budget is spent"
        return result
    started = time.monotonic()
    with GpuWatch(gpu) as watch:
        for planned in step.commands:
            try:
                command = planned() if callable(planned) else planned
            except (OSError, IndexError) as err:
                result.status, result.note = "failed", f"cannot build a command: {err}"
                break
            result.commands.append(" ".join(command))
            left = timeout_s - (time.monotonic() - started)
            code = _run_command(command, {**env, **step.env}, left, logfile)
            if code != 0:
                result.status = "timeout" if code == -1 else "failed"
                result.note = f"`{' '.join(command[:4])} ...` " + (
                    f"was stopped at the step's {timeout_s:.0f} s"
                    if code == -1
                    else f"exited {code} (gpu_check.log)"
                )
                break
    result.seconds = time.monotonic() - started
    result.gpu = watch.summary()
    try:
        result.metrics = step.collect()
    except CheckFailed as err:
        if result.status == "ok":
            result.status, result.note = "failed", str(err)
    except (OSError, KeyError, ValueError, TypeError) as err:
        if result.status == "ok":
            result.status = "failed"
            result.note = f"its output is missing or malformed: {type(err).__name__}: {err}"
    return result


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _config_fields() -> dict[str, object]:
    """TrainConfig's fields of this checkout and their defaults (what an override may name)."""
    from fedst.experiment.config import TrainConfig

    return {f.name: f.default for f in dataclasses.fields(TrainConfig)}


def _compile_override(fields: dict, mode: str | None) -> str:
    """``train.compile`` for ``mode`` (None: off) in this checkout's form: a mode string, or a
    bool where the field is still one."""
    if isinstance(fields.get("compile"), bool):
        return f"train.compile={'false' if mode is None else 'true'}"
    return f"train.compile={'none' if mode is None else mode}"


@dataclass(frozen=True)
class Sizes:
    """The reduced (``--cpu``) or full (GPU) sizes of every step."""

    image: tuple[int, int]
    rounds: int
    """paper_scale's rounds: the first warms up, the ones that neither evaluate nor save a
    checkpoint give the busy fraction (bench/paper_scale.py, training_rounds)."""
    local_iters: int
    """Site iterations per paper_scale round (the paper's 100: enough that per-round host work
    is amortised as there)."""
    eval_every: int
    """paper_scale evaluates at this round (a non-last evaluation: the cost per frame) and at
    the last."""
    pretrain_iters: int
    """Synthetic pre-training steps; the first 2 are warm-up, not timed."""
    eval_frames: int
    step_iters: int
    step_repeats: int
    stream_frames: int
    scoring_repeats: int
    compile_backend: str
    budget_s: float
    options_rounds: int | None
    options_local_iters: int
    """The baseline and options runs of paper_scale: only their ms per site step is compared.
    None: not run (on the GPU; see ``GPU_SIZES``)."""
    federation: tuple[str, ...] = ()
    """Overrides of the tiny federation (beyond experiment=tiny)."""
    outfed_frames: int | None = None
    """eval_outfed.py's max_frames (None: all)."""
    timeout_scale: float = 1.0
    """Every step's time limit is multiplied by this (a loaded 2-core CPU is slow to start)."""


GPU_TEST_FILES = (
    "tests/test_gpu_check.py::test_a_training_step_on_the_test_device_gives_the_cpu_s_loss_and_gradients",
    "tests/test_gpu_check.py::test_streaming_on_the_test_device_gives_the_cpu_s_logits",
    "tests/test_device_scoring.py",
    "tests/test_federation.py::test_a_two_round_federation_writes_every_output",
)
"""The tests that run on CUDA there: the two that compare the test device ($FEDST_TEST_DEVICE)
with the CPU, the pixel counts on CUDA (and the rest of that file, which takes seconds), and a
tiny federation whose ``train.device=auto`` resolves to the GPU. The other test files pin the CPU
or monkeypatch CUDA away."""

GPU_SIZES = Sizes(
    image=(512, 640),
    rounds=4,
    local_iters=20,
    eval_every=3,
    pretrain_iters=8,
    eval_frames=48,
    step_iters=5,
    step_repeats=3,
    stream_frames=60,
    scoring_repeats=20,
    compile_backend="inductor",
    budget_s=460,
    options_rounds=None,
    options_local_iters=10,
)
"""On the H200 (2026-11-28) each process started in ~10 s, the first round of a 512x640 run took
~35 s (cuDNN autotuning, loader start) and each later one ~15 s: a baseline or options run of
paper_scale needs ~95 s, which the budget cannot give, so the GPU check leaves them out and the
``step`` step compares the options in one process (docs/paper-scale.md)."""
CPU_SIZES = Sizes(
    image=(64, 80),
    rounds=4,
    local_iters=1,
    eval_every=3,
    pretrain_iters=3,
    eval_frames=2,
    step_iters=1,
    step_repeats=1,
    stream_frames=3,
    scoring_repeats=2,
    compile_backend="eager",
    budget_s=1680,
    options_rounds=2,
    options_local_iters=1,
    federation=("train.total_iters=1", "train.local_iters=1", "train.eval_max_frames=1"),
    outfed_frames=1,
    timeout_scale=4.0,
)

STEP_LIMITS_S = {
    "facts": 25,
    "federation": 75,
    "paper_scale": 170,
    "tests": 55,
    "scoring": 20,
    "step": 55,
    "stream": 60,
    "paper_scale_baseline": 45,
    "paper_scale_options": 45,
}
"""Each step's limit on the GPU (times ``Sizes.timeout_scale`` on the CPU), in the order they
run (by value: facts, federation, paper scale, tests, scoring, step, stream, options). Set from
the first run on the H200 (docs/paper-scale.md): a process there starts in ~10 s, matplotlib
builds its font cache once (~17 s, in ``facts``), and paper_scale at 4 rounds needs ~160 s. The
steps the GPU check runs add up to ``GPU_SIZES.budget_s``, so every step gets its turn."""

RUN_TIMEOUT_S = 520
"""The device tool's ``timeout_s`` for ``bash bench/gpu_check.sh``: the 460 s of steps, the
wheel install and pre-flight (about 25 s) and a margin. With a machine's start (30-120 s) it
leaves more than the 4 minutes of the 15-minute lease that a second, shorter call needs;
docs/paper-scale.md gives the call."""


def plan_steps(device: str, sizes: Sizes, work: Path) -> list[Step]:
    """The check's steps for ``device`` at ``sizes``; ``work`` holds their files."""
    python = sys.executable
    height, width = sizes.image
    fields = _config_fields()
    fed, infer = work / "federation" / "run", work / "federation" / "infer"
    tiny_root = work / "tiny"
    fed_overrides = [
        "experiment=tiny",
        f"train.device={device}",
        f"data.root={tiny_root}",
        f"hydra.run.dir={fed}",
        "progress=false",
        *sizes.federation,
    ]
    outfed = [] if sizes.outfed_frames is None else [f"max_frames={sizes.outfed_frames}"]

    def infer_command() -> list[str]:  # site A's first test video, once train_fed.py made it
        site = tiny_root / "A"
        video = (site / "splits" / "test.txt").read_text().split()[0]
        return [
            python,
            "-m",
            "fedst.infer",
            f"run={fed}",
            "site=A",
            f"input={site / 'videos' / video / 'frames'}",
            "fps=5",
            f"device={device}",
            f"output={infer}",
            "progress=false",
        ]

    def paper_scale(name: str, title: str, extra: list[str], rounds: int, iters: int) -> Step:
        missing = [o.split("=")[0] for o in extra if o.split("=")[0][6:] not in fields]
        path = work / f"{name}.json"
        main_run = name == "paper_scale"
        command = [
            python,
            "-m",
            "bench.paper_scale",
            "--tiny-data",
            "--tiny-preset",
            "gpu_check",
            "--image-size",
            str(height),
            str(width),
            "--rounds",
            str(rounds),
            "--local-iters",
            str(iters),
            "--eval-every",
            str(sizes.eval_every if main_run else rounds),
            "--pretrain-iters",
            str(sizes.pretrain_iters if main_run else 1),
            "--eval-frames",
            str(sizes.eval_frames),
            "--data-root",
            str(work / "gpu_check_data"),
            "--keep",
            str(work / name / "run"),
            "--json",
            str(path),
            f"train.device={device}",
            *extra,
        ]
        if device == "cpu":
            command.append("train.num_workers=0")
        return Step(
            name,
            title,
            STEP_LIMITS_S[name],
            [command],
            collect=lambda: _load(path),
            unsupported=(
                f"this checkout's TrainConfig has no field {', '.join(missing)}"
                if missing
                else None
            ),
            measures=PAPER_SCALE_MEASURES
            if main_run
            else "ms_per_site_step (compared with "
            "the other paper_scale runs); the other figures as paper_scale's, over fewer rounds",
        )

    def bench(module: str, *args: str, **options: object) -> list[str]:
        """``python -m <module> [args] --device <device> --<option> <value> ...``"""
        flags = [
            f for key, value in options.items() for f in (f"--{key.replace('_', '-')}", str(value))
        ]
        return [python, "-m", module, *args, "--device", device, *flags]

    baseline = ["train.amp_dtype=none", "train.tf32=false", _compile_override(fields, None)]
    if "channels_last" in fields:
        baseline.append("train.channels_last=false")
    options = [_compile_override(fields, "reduce-overhead"), "train.channels_last=true"]
    if device == "cpu":  # inductor's C++ build takes minutes on 2 cores: channels_last only
        options = ["train.channels_last=true"]
    step_json, stream_json = work / "step.json", work / "stream.json"
    facts_json, scoring_json = work / "facts.json", work / "scoring.json"
    size_args = ["--size", str(height), str(width)]
    return [
        Step(
            "facts",
            "device facts",
            STEP_LIMITS_S["facts"],
            [bench("bench.gpu_check", "facts", json=facts_json)],
            collect=lambda: _load(facts_json),
            measures="the machine as the check found it: torch, CUDA, the card, TF32 flags",
        ),
        Step(
            "federation",
            f"tiny federation end to end on {device}: train_fed.py, eval_outfed.py, fedst.infer",
            STEP_LIMITS_S["federation"],
            [
                [python, "train_fed.py", *fed_overrides],
                [python, "eval_outfed.py", f"run={fed}", "progress=false", *outfed],
                infer_command,
            ],
            collect=lambda: check_federation(fed, infer, device),
            measures="that the entry points run on the device (config.json and CUDA memory in "
            "train.jsonl); no timing",
        ),
        paper_scale(
            "paper_scale",
            f"paper_scale at {height}x{width}, paper.yaml's options",
            [],
            sizes.rounds,
            sizes.local_iters,
        ),
        Step(
            "tests",
            f"the tests that run on CUDA, with FEDST_TEST_DEVICE={device}",
            STEP_LIMITS_S["tests"],
            [[python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *GPU_TEST_FILES]],
            env={"FEDST_TEST_DEVICE": device},
            measures="pass or fail of " + ", ".join(GPU_TEST_FILES),
        ),
        Step(
            "scoring",
            f"Dice / IoU pixel counts of one 1080p frame on {device} (bench.scoring)",
            STEP_LIMITS_S["scoring"],
            [bench("bench.scoring", repeats=sizes.scoring_repeats, json=scoring_json)],
            collect=lambda: _load(scoring_json),
            measures=f"ms per 1080x1920 frame of evaluation's scoring on {device} (median of "
            f"{sizes.scoring_repeats}, host copy and sync included) against MONAI's one-hot "
            "path on the CPU; the scores must be equal",
        ),
        Step(
            "step",
            f"training step at {height}x{width}: baseline (fp32, eager) vs the options",
            STEP_LIMITS_S["step"],
            [
                bench(
                    "bench.gpu_check",
                    "step",
                    *size_args,
                    iters=sizes.step_iters,
                    repeats=sizes.step_repeats,
                    budget_s=(STEP_LIMITS_S["step"] - 10) * sizes.timeout_scale,
                    compile_backend=sizes.compile_backend,
                    json=step_json,
                )
            ],
            collect=lambda: _load(step_json),
            measures=f"ms per training step (batch 2 of 4-frame clips, AdamW), the lowest mean "
            f"of {sizes.step_repeats} x {sizes.step_iters} steps after 3 warm-up steps, in one "
            "process; speed-ups against its fp32 eager baseline",
        ),
        Step(
            "stream",
            f"streaming inference FPS at {height}x{width}",
            STEP_LIMITS_S["stream"],
            [
                bench(
                    "bench.gpu_check",
                    "stream",
                    *size_args,
                    frames=sizes.stream_frames,
                    budget_s=(STEP_LIMITS_S["stream"] - 5) * sizes.timeout_scale,
                    compile_backend=sizes.compile_backend,
                    json=stream_json,
                )
            ],
            collect=lambda: _load(stream_json),
            measures=f"ms per frame (p50, p95) over {sizes.stream_frames} frames after warm-up, "
            "batch 1, a host sync per frame; logits of the first frames against eager fp32's. "
            "The paper reports 23 FPS (its GPU, its input size)",
        ),
    ] + (
        []
        if sizes.options_rounds is None
        else [
            paper_scale(
                "paper_scale_baseline",
                "paper_scale with none of the options (fp32, eager)",
                baseline,
                sizes.options_rounds,
                sizes.options_local_iters,
            ),
            paper_scale(
                "paper_scale_options",
                f"paper_scale with {' '.join(options)}",
                options,
                sizes.options_rounds,
                sizes.options_local_iters,
            ),
        ]
    )


PAPER_SCALE_MEASURES = (
    "ms_per_site_step: site compute per iteration over the rounds after the first; "
    "gpu_busy_fraction: nvidia-smi utilisation (every 100 ms) over the rounds that only train "
    "(gpu_busy_rounds: not the first or last, no evaluation, no checkpoint); "
    "evaluation_seconds_per_frame: the non-last evaluation (evaluation_rounds) over its frames, "
    "loader start included; pretrain_seconds_per_iter: the steps after 2 warm-up steps; "
    "paper_run_hours: 300 rounds x 100 iterations x 4 sites + SERQ + evaluation every 10 rounds "
    "+ 3000 pre-training iterations from these units (the paper: 43.8 h on one RTX A5000)"
)


def write_report(out: Path, header: dict, results: list[StepResult]) -> None:
    """gpu_check.json (everything) and gpu_check.md (a table and each step's figures)."""
    payload = {**header, "steps": [dataclasses.asdict(r) for r in results]}
    (out / "gpu_check.json").write_text(json.dumps(payload, indent=1, default=str))
    lines = [
        f"# GPU check: {header['mode']}",
        "",
        f"{header['started']}, {header['host']}; card: {header.get('card', 'not yet known')}; "
        f"budget {header['budget_s']:.0f} s, elapsed {header['elapsed_s']:.0f} s",
        "",
        "The paper's figures for comparison: 43.8 h for its whole training on one RTX A5000, "
        "23 FPS at inference (Sec. IV). Requirement report of this python (pip_list.txt, "
        f"requirements.txt): {header.get('requirements', 'not written')}",
        "",
        "| step | status | s | GPU util % (mean) | GPU mem MiB (max) | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        util = r.gpu.get("utilization_mean_pct")
        used = r.gpu.get("memory_used_max_mib")
        lines.append(
            f"| {r.name} | {r.status} | {r.seconds:.0f} | "
            f"{'-' if util is None else f'{util:.0f}'} | {'-' if used is None else f'{used:.0f}'} "
            f"| {r.note.replace('|', '/')} |"
        )
    for r in results:
        if r.metrics or r.commands:
            lines += ["", f"## {r.name}: {r.title}", ""]
            if r.measures:
                lines += [f"What it measures: {r.measures}.", ""]
            lines += [f"    {command}" for command in r.commands] + [""]
            lines += _metrics_markdown(r.metrics)
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def _number(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _metrics_markdown(metrics: dict) -> list[str]:
    """A step's figures: a table of its variants (step, stream), else one line per figure."""
    variants = metrics.get("variants")
    if isinstance(variants, dict):
        lines = [
            "| variant | status | ms (p50) | ms p95 | FPS (p50) | speed-up vs baseline "
            "| peak GiB | max abs diff vs eager fp32 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, v in variants.items():
            ms = v.get("ms_per_step", v.get("ms_p50"))
            cells = [
                ms,
                v.get("ms_p95"),
                v.get("fps"),
                v.get("speedup_vs_baseline"),
                v.get("peak_allocated_gib"),
                v.get("max_abs_diff_vs_eager_fp32"),
            ]
            lines.append(
                f"| {name} | {v.get('status', '').replace('|', '/')[:200]} | "
                + " | ".join("-" if c is None else _number(c) for c in cells)
                + " |"
            )
        rest = {k: v for k, v in metrics.items() if k != "variants"}
        return [*lines, "", *(f"* {k}: {_number(v)}" for k, v in rest.items())]
    lines = []
    for key, value in metrics.items():
        if isinstance(value, dict):
            inner = ", ".join(f"{k} {_number(v)}" for k, v in value.items())
            lines.append(f"* {key}: {inner}")
        elif key != "command":
            lines.append(f"* {key}: {_number(value)}")
    return lines


def run_check(
    cpu: bool, out: Path, budget_s: float | None, keep_work: Path | None = None
) -> list[StepResult]:
    """Every step in order within the overall budget; the report is rewritten after each.

    The steps' files (runs, generated data: about 1.7 GB on the CPU) go to ``keep_work`` when it
    is given, else to a temporary directory removed at the end (bench/scratch.py).
    """
    with scratch_dir("fedst_gpu_check_", keep_work) as work:
        return _run_steps(cpu, out, budget_s, work, removed=keep_work is None)


def _run_steps(
    cpu: bool, out: Path, budget_s: float | None, work: Path, removed: bool
) -> list[StepResult]:
    out.mkdir(parents=True, exist_ok=True)
    sizes = CPU_SIZES if cpu else GPU_SIZES
    budget = budget_s if budget_s is not None else sizes.budget_s
    device = "cpu" if cpu else "cuda"
    steps = plan_steps(device, sizes, work)
    env = {**child_environment(), "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    header = {
        "mode": "cpu (reduced sizes)" if cpu else "gpu",
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "budget_s": budget,
        "elapsed_s": 0.0,
        "work_dir": f"{work} (removed at the end)" if removed else str(work),
    }
    requirements = out / "requirements.txt"
    if requirements.is_file():  # written by gpu_check.sh before the steps
        unmet = [line for line in requirements.read_text().splitlines() if line.strip()]
        header["requirements"] = (
            "every requirement met" if not unmet else f"{len(unmet)} lines, see requirements.txt"
        )
    results: list[StepResult] = []
    with open(out / "gpu_check.log", "a") as logfile:
        for step in steps:
            left = budget - (time.monotonic() - started)
            log.info("step %s (%.0f s left)", step.name, left)
            limit = min(step.timeout_s * sizes.timeout_scale, left)
            result = run_step(step, env, limit, not cpu, logfile)
            log.info(
                "step %s: %s in %.0f s %s", step.name, result.status, result.seconds, result.note
            )
            results.append(result)
            if step.name == "facts" and result.metrics.get("card"):
                header["card"] = result.metrics["card"]
            header["elapsed_s"] = time.monotonic() - started
            write_report(out, header, results)
    return results


def failed_steps(results: list[StepResult]) -> list[str]:
    """The steps that did not end "ok" (failed, timeout, not run, unsupported): any makes the
    check exit non-zero, so a lost figure is never a silent success."""
    return [f"{r.name} ({r.status})" for r in results if r.status != "ok"]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("wheels", help="fill .whl/ with the wheels the GPU machine lacks")
    check = sub.add_parser("run", help="every step; the report in --out")
    check.add_argument("--cpu", action="store_true", help="on the CPU at a reduced size")
    check.add_argument("--out", type=Path, default=REPO / "gpu_check_out")
    check.add_argument("--budget-s", type=float, default=None, help="overall time budget")
    check.add_argument(
        "--keep-work", type=Path, default=None,
        help="keep the steps' runs and data here (default: a temporary directory, removed)",
    )  # fmt: skip
    facts = sub.add_parser("facts")
    facts.add_argument("--device", default="cuda")
    facts.add_argument("--json", type=Path, required=True)
    flight = sub.add_parser("preflight", help="exit 3 with the reason when the device is unusable")
    flight.add_argument("--device", default="cuda")
    sub.add_parser("requirements", help="print the installed packages' unmet requirements")
    for name in ("step", "stream"):
        bench = sub.add_parser(name)
        bench.add_argument("--device", default="cuda")
        bench.add_argument("--size", type=int, nargs=2, default=(512, 640))
        bench.add_argument("--iters", type=int, default=5)
        bench.add_argument("--repeats", type=int, default=3)
        bench.add_argument("--frames", type=int, default=40)
        bench.add_argument("--budget-s", type=float, default=80)
        bench.add_argument("--compile-backend", default="inductor")
        bench.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "wheels":
        make_wheels()
    elif args.command == "run":
        results = run_check(args.cpu, args.out, args.budget_s, args.keep_work)
        bad = failed_steps(results)
        print(f"report: {args.out / 'gpu_check.md'}; not ok: {', '.join(bad) or 'none'}")
        return 1 if bad else 0
    elif args.command == "preflight":
        reason = preflight(args.device)
        if reason is not None:
            print(f"gpu_check: no usable {args.device} device: {reason}", file=sys.stderr)
            return 3
    elif args.command == "requirements":
        print("\n".join(requirement_report()))
    elif args.command == "facts":
        _write_json(args.json, device_facts(args.device))
    elif args.command == "step":
        bench_step(
            args.device,
            tuple(args.size),
            args.iters,
            args.repeats,
            args.budget_s,
            args.compile_backend,
            args.json,
        )
    elif args.command == "stream":
        bench_stream(
            args.device,
            tuple(args.size),
            args.frames,
            args.budget_s,
            args.compile_backend,
            args.json,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

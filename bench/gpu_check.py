"""The prepared GPU check (issue 33, item 9): every GPU-relevant check of FedST in one command, on
a borrowed machine with one H100 (or H200), 16 cores, no network and a ``python3`` that already
holds torch 2.11, timm, onnx, onnxruntime, OpenCV, matplotlib, TensorBoard and pytest.

    make gpu-wheels                 # here: the wheels that machine lacks, into .whl/ (git-ignored)
    bash bench/gpu_check.sh         # there, from the repository root: report in $OUT or gpu_check_out/
    bash bench/gpu_check.sh --cpu   # anywhere: the same steps on the CPU at a reduced size

Steps, in this order, each with its own time limit inside one overall budget (``--budget-s``,
360 s on a GPU): ``facts`` (torch, CUDA, card, dtype, TF32, package versions); ``federation`` (a
tiny federation on the device with ``train_fed.py``, then ``eval_outfed.py`` and ``fedst.infer``,
checking that the device was really used); ``paper_scale`` (``bench.paper_scale --tiny-data`` at
512x640 with paper.yaml's settings: ms per site step, GPU busy fraction, SERQ's, the loader
wait's and the evaluation's shares, peak memory, the paper's run in hours); ``step`` (one training
step of the network, batch 2 of 4-frame clips at 512x640, with none of the options against TF32,
bf16, channels_last and torch.compile, in one process, so the ratios come from one run);
``stream`` (streaming inference FPS at 512x640: eager fp32, bf16 and fp16 autocast, compiled, and
ONNX Runtime with its CUDA provider where present); ``tests`` (the CUDA-relevant test files with
``FEDST_TEST_DEVICE=cuda``); ``paper_scale_baseline`` (fp32, no TF32, no compile, no
channels_last); ``paper_scale_options`` (``train.compile`` and ``train.channels_last`` on).

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

CARRIED_ANYWAY = {
    "protobuf": "flwr's generated code needs protobuf >= 5.29 and grpcio-health-checking's >= "
    "6.33.5; the machine's version is not recorded",
}
"""Packages the machine has that travel anyway, in our version, and why."""

TRAVEL_LIMIT_BYTES = 64 * 1024**2
"""The working tree plus the wheels: what one device call may carry."""

WHEEL_DIR = REPO / ".whl"


def _environment(extra: str = "") -> dict[str, str]:
    """Marker environment of the GPU machine's python3 (for requirement markers)."""
    return {
        "python_version": GPU_MACHINE_PYTHON,
        "python_full_version": f"{GPU_MACHINE_PYTHON}.3",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": extra,
    }


def wheel_plan(
    roots: list[str] | None = None, present: frozenset[str] = GPU_MACHINE_PACKAGES
) -> dict[str, str]:
    """name -> version (this environment's) of every distribution the GPU machine needs and
    lacks: the closure of fedst's requirements (``roots``, default fedst's own, without extras),
    descending only into packages the machine lacks (its own packages bring their own needs),
    extras of a requirement included, plus :data:`CARRIED_ANYWAY`. Raises when a needed package
    is not installed here."""
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
        if req.marker is not None and not req.marker.evaluate(_environment()):
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
            if sub.marker is None or any(sub.marker.evaluate(_environment(e)) for e in wanted):
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


def fetch_wheels(plan: dict[str, str], dest: Path = WHEEL_DIR) -> list[Path]:
    """Download each planned wheel for the GPU machine into ``dest`` (kept when already there);
    a pure-Python package published only as a source archive is built into a ``none-any`` wheel
    here. Files of other versions or packages are removed: two versions stop the install."""
    dest.mkdir(exist_ok=True)
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
            GPU_MACHINE_PYTHON,
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
                    f"{GPU_MACHINE_PYTHON} manylinux x86-64 and builds only a platform wheel "
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
    try:
        import onnxruntime

        facts["onnxruntime_providers"] = onnxruntime.get_available_providers()
    except ImportError:
        facts["onnxruntime_providers"] = []
    return facts


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
    import torch

    if device.type == "cuda":
        precision = "tf32" if enabled else "ieee"
        torch.backends.cuda.matmul.fp32_precision = precision
        torch.backends.cudnn.conv.fp32_precision = precision


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
    (a viewer needs each frame's logits): eager fp32, bf16 and fp16 autocast, compiled (fp32 and
    bf16), and ONNX Runtime (CUDA provider on a GPU when installed, else the CPU provider)."""
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

    def run(name: str, stream_net, dtype: str | None, warmup: int) -> None:
        if time.monotonic() - started > budget_s * 0.7:
            result["variants"][name] = {"status": "not run: time budget"}
            return
        try:
            state = stream_net.stream(indicator, interval_s=interval_s)
            times = []
            with torch.no_grad(), _autocast(device, dtype):
                for index in range(warmup + frames):
                    begin = time.perf_counter()
                    state.step(video[index % len(video)], index / fps_of_video)
                    _sync(device)
                    times.append(time.perf_counter() - begin)
            timed = times[warmup:]
            result["variants"][name] = {
                "status": "ok",
                "fps": 1 / median(timed),
                "ms_median": median(timed) * 1e3,
                "first_frames_seconds": sum(times[:warmup]),
            }
        except Exception as err:
            result["variants"][name] = {"status": f"failed: {type(err).__name__}: {err}"}
        _write_json(out, result)

    _set_tf32(device, True)
    run("eager fp32 (TF32)", net, None, warmup=6)
    if device.type == "cuda":
        run("eager bf16 autocast", net, "bf16", warmup=6)
        run("eager fp16 autocast", net, "fp16", warmup=6)
    compiled = copy.deepcopy(net)
    _compile_streaming(compiled, compile_backend, "default")
    run(f"compiled fp32 ({compile_backend})", compiled, None, warmup=12)
    if device.type == "cuda":
        run(f"compiled bf16 ({compile_backend})", compiled, "bf16", warmup=12)
    _bench_onnx(net.cpu(), indicator.cpu(), size, frames, device, result, out)
    return result


def _bench_onnx(net, indicator, size, frames, device, result: dict, out: Path | None) -> None:
    """ONNX Runtime streaming of ``fedst.export``'s graph: its CUDA provider on a GPU when the
    installed onnxruntime has it, else the CPU provider (named in the result)."""
    name = "ONNX Runtime"
    try:
        import numpy as np
        import onnxruntime as ort

        from fedst.export import OnnxStreamer, export_onnx

        available = ort.get_available_providers()
        provider = (
            "CUDAExecutionProvider"
            if device.type == "cuda" and "CUDAExecutionProvider" in available
            else "CPUExecutionProvider"
        )
        name = f"ONNX Runtime {provider}"
        with tempfile.TemporaryDirectory() as tmp:
            path = export_onnx(net, indicator, size, 0.2, Path(tmp) / "fedst.onnx")
            streamer = OnnxStreamer(path)
            # OnnxStreamer builds a CPU session; the same graph on the chosen provider
            streamer.session = ort.InferenceSession(str(path), providers=[provider])
            frame = np.random.default_rng(0).standard_normal((1, 3, *size), dtype=np.float32)
            times = []
            for index in range(6 + frames):
                begin = time.perf_counter()
                streamer.step(frame, index / 25.0)
                times.append(time.perf_counter() - begin)
        timed = times[6:]
        result["variants"][name] = {
            "status": "ok",
            "fps": 1 / median(timed),
            "ms_median": median(timed) * 1e3,
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
    result = StepResult(step.name, step.title, "ok")
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
    local_iters: int
    pretrain_iters: int
    eval_frames: int
    step_iters: int
    step_repeats: int
    stream_frames: int
    compile_backend: str
    test_files: tuple[str, ...]
    budget_s: float
    federation: tuple[str, ...] = ()
    """Overrides of the tiny federation (beyond experiment=tiny)."""
    outfed_frames: int | None = None
    """eval_outfed.py's max_frames (None: all)."""
    timeout_scale: float = 1.0
    """Every step's time limit is multiplied by this (a loaded 2-core CPU is slow to start)."""


GPU_SIZES = Sizes(
    image=(512, 640),
    rounds=3,
    local_iters=4,
    pretrain_iters=2,
    eval_frames=8,
    step_iters=5,
    step_repeats=3,
    stream_frames=40,
    compile_backend="inductor",
    test_files=(
        "tests/test_devices.py",
        "tests/test_metrics.py",
        "tests/test_evaluation.py",
        "tests/test_network.py",
        "tests/test_temporal.py",
        "tests/test_serq_bank.py",
        "tests/test_serq_descriptor.py",
        "tests/test_serq_finetune.py",
        "tests/test_serq_stream.py",
        "tests/test_infer.py",
        "tests/test_gpu_check.py",
        "tests/test_federation.py::test_a_two_round_federation_writes_every_output",
    ),
    budget_s=360,
)
CPU_SIZES = Sizes(
    image=(64, 80),
    rounds=1,
    local_iters=1,
    pretrain_iters=1,
    eval_frames=1,
    step_iters=1,
    step_repeats=1,
    stream_frames=3,
    compile_backend="eager",
    test_files=("tests/test_devices.py", "tests/test_gpu_check.py"),
    budget_s=1500,
    federation=("train.total_iters=1", "train.local_iters=1", "train.eval_max_frames=1"),
    outfed_frames=1,
    timeout_scale=4.0,
)


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

    def paper_scale(name: str, title: str, extra: list[str], timeout_s: float) -> Step:
        missing = [o.split("=")[0] for o in extra if o.split("=")[0][6:] not in fields]
        path = work / f"{name}.json"
        command = [
            python,
            "-m",
            "bench.paper_scale",
            "--tiny-data",
            "--image-size",
            str(height),
            str(width),
            "--rounds",
            str(sizes.rounds),
            "--local-iters",
            str(sizes.local_iters),
            "--pretrain-iters",
            str(sizes.pretrain_iters),
            "--eval-frames",
            str(sizes.eval_frames),
            "--data-root",
            str(tiny_root),
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
            timeout_s,
            [command],
            collect=lambda: _load(path),
            unsupported=(
                f"this checkout's TrainConfig has no field {', '.join(missing)}"
                if missing
                else None
            ),
        )

    baseline = ["train.amp_dtype=none", "train.tf32=false", _compile_override(fields, None)]
    if "channels_last" in fields:
        baseline.append("train.channels_last=false")
    options = [_compile_override(fields, "reduce-overhead"), "train.channels_last=true"]
    if device == "cpu":  # inductor's C++ build takes minutes on 2 cores: channels_last only
        options = ["train.channels_last=true"]
    step_json, stream_json = work / "step.json", work / "stream.json"
    facts_json = work / "facts.json"
    return [
        Step(
            "facts",
            "device facts",
            30,
            [
                [
                    python,
                    "-m",
                    "bench.gpu_check",
                    "facts",
                    "--device",
                    device,
                    "--json",
                    str(facts_json),
                ]
            ],
            collect=lambda: _load(facts_json),
        ),
        Step(
            "federation",
            f"tiny federation end to end on {device}: train_fed.py, eval_outfed.py, fedst.infer",
            75,
            [
                [python, "train_fed.py", *fed_overrides],
                [python, "eval_outfed.py", f"run={fed}", "progress=false", *outfed],
                infer_command,
            ],
            collect=lambda: check_federation(fed, infer, device),
        ),
        paper_scale(
            "paper_scale", f"paper_scale at {height}x{width}, paper.yaml's options", [], 75
        ),
        Step(
            "step",
            f"training step at {height}x{width}: baseline (fp32, eager) vs the options",
            75,
            [
                [
                    python,
                    "-m",
                    "bench.gpu_check",
                    "step",
                    "--device",
                    device,
                    "--size",
                    str(height),
                    str(width),
                    "--iters",
                    str(sizes.step_iters),
                    "--repeats",
                    str(sizes.step_repeats),
                    "--budget-s",
                    str(65 * sizes.timeout_scale),
                    "--compile-backend",
                    sizes.compile_backend,
                    "--json",
                    str(step_json),
                ]
            ],
            collect=lambda: _load(step_json),
        ),
        Step(
            "stream",
            f"streaming inference FPS at {height}x{width}",
            60,
            [
                [
                    python,
                    "-m",
                    "bench.gpu_check",
                    "stream",
                    "--device",
                    device,
                    "--size",
                    str(height),
                    str(width),
                    "--frames",
                    str(sizes.stream_frames),
                    "--budget-s",
                    str(55 * sizes.timeout_scale),
                    "--compile-backend",
                    sizes.compile_backend,
                    "--json",
                    str(stream_json),
                ]
            ],
            collect=lambda: _load(stream_json),
        ),
        Step(
            "tests",
            f"CUDA-relevant tests with FEDST_TEST_DEVICE={device}",
            90,
            [
                [
                    python,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "-k",
                    "not script_on_the_cpu",
                    *sizes.test_files,
                ]
            ],
            env={"FEDST_TEST_DEVICE": device},
        ),
        paper_scale(
            "paper_scale_baseline",
            "paper_scale with none of the options (fp32, eager)",
            baseline,
            60,
        ),
        paper_scale("paper_scale_options", f"paper_scale with {' '.join(options)}", options, 90),
    ]


def write_report(out: Path, header: dict, results: list[StepResult]) -> None:
    """gpu_check.json (everything) and gpu_check.md (a table and each step's figures)."""
    payload = {**header, "steps": [dataclasses.asdict(r) for r in results]}
    (out / "gpu_check.json").write_text(json.dumps(payload, indent=1, default=str))
    lines = [
        f"# GPU check: {header['mode']}",
        "",
        f"{header['started']}, {header['host']}; budget {header['budget_s']:.0f} s, "
        f"elapsed {header['elapsed_s']:.0f} s",
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
            "| variant | status | ms | FPS | speed-up vs baseline | peak GiB |",
            "|---|---|---|---|---|---|",
        ]
        for name, v in variants.items():
            ms = v.get("ms_per_step", v.get("ms_median"))
            cells = [ms, v.get("fps"), v.get("speedup_vs_baseline"), v.get("peak_allocated_gib")]
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
    env = {
        **os.environ,
        "FLWR_TELEMETRY_ENABLED": "0",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    started = time.monotonic()
    header = {
        "mode": "cpu (reduced sizes)" if cpu else "gpu",
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "budget_s": budget,
        "elapsed_s": 0.0,
        "work_dir": f"{work} (removed at the end)" if removed else str(work),
    }
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
            header["elapsed_s"] = time.monotonic() - started
            write_report(out, header, results)
    return results


def main(argv: list[str] | None = None) -> None:
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
        bad = [r.name for r in results if r.status != "ok"]
        print(f"report: {args.out / 'gpu_check.md'}; not ok: {bad or 'none'}")
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


if __name__ == "__main__":
    main()

"""Specification of what a run states about its device and memory (fedst/accel/,
fedst/accel/device.py resolve_device, fedst/training.py record_device, fedst/export.py):
no silent CPU fallback for a GPU-sized config, TF32 switches that agree, deterministic
algorithms, native-bf16 detection, per-phase GPU memory and an export that leaves the caller's
model alone. CPU only: CUDA facts (availability, capability, allocator counters) are mocked, and
process-wide torch switches are set in a child process."""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fedst import accel, training
from fedst.accel import memory, resolve_device
from fedst.app import reply_logs
from fedst.cli import compose_experiment
from fedst.config import ConfigError
from fedst.experiment import run_device
from fedst.federation import transport
from fedst.runs import Run
from fedst.runs.files import RunLog
from fedst.runs.layout import DEVICE_JSONL
from fedst.storage import read_jsonl
from tests.conftest import train_reply

REPO = Path(__file__).resolve().parents[1]
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def run_child(code: str, env: dict[str, str] | None = None) -> dict:
    """Run ``code`` in a fresh interpreter (process-wide torch switches stay out of this one);
    it prints one JSON object, returned here."""
    import os

    child_env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env={**child_env, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- no silent CPU fallback ------------------------------------------------------------------------


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_auto_on_a_gpu_sized_config_without_cuda_is_refused_with_the_fix(no_cuda):
    paper, _ = compose_experiment(["experiment=paper"])
    assert paper.train.require_gpu and paper.train.device == "auto"
    with pytest.raises(ConfigError) as refused:
        run_device(paper)
    message = str(refused.value)
    assert "train.device=auto found no CUDA device" in message
    assert f"torch {torch.__version__}" in message and "experiment=paper" in message
    assert "pass train.device=cpu to run it on the CPU anyway" in message
    assert "\n" not in message  # one line
    explicit, _ = compose_experiment(["experiment=paper", "train.device=cpu"])
    assert run_device(explicit) == CPU  # asked for: runs there
    tiny, _ = compose_experiment(["experiment=tiny"])
    assert not tiny.train.require_gpu and run_device(tiny) == CPU  # not sized for a GPU
    with pytest.raises(ConfigError, match=r"train\.device='cuda' but CUDA is not available"):
        resolve_device("cuda")


def test_the_reason_names_a_cpu_only_build_and_hidden_gpus(monkeypatch, no_cuda):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "CUDA_VISIBLE_DEVICES='' hides every GPU" in accel.cuda_unavailable_reason()
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=''"):
        resolve_device("auto", require_gpu=True, experiment="paper")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    assert accel.cuda_unavailable_reason() == "this torch is a CPU-only build"


def test_a_refused_run_writes_nothing(tmp_path, no_cuda):
    paper, _ = compose_experiment(["experiment=paper", f"data.root={tmp_path / 'data'}"])
    with pytest.raises(ConfigError, match="found no CUDA device"):
        training.prepare_run(paper, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_every_entry_point_resolves_the_device_by_one_rule_that_honours_require_gpu():
    """Training, evaluation, reports, the guard and eval_outfed.py take the device from
    fedst.experiment.run_device (``train.device`` with ``train.require_gpu``), mostly through
    ``Run.device``: no other call resolves ``train.device`` (fedst.infer's own ``device`` aside)."""
    repo = Path(__file__).resolve().parents[1]
    callers = []
    for path in [
        *sorted((repo / "fedst").rglob("*.py")),
        repo / "eval_outfed.py",
        repo / "train_fed.py",
    ]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "resolve_device":
                callers.append(str(path.relative_to(repo)))
    assert sorted(callers) == ["fedst/experiment/config.py", "fedst/infer/streaming.py"]


def test_a_run_scored_on_a_cpu_refuses_a_gpu_sized_config_as_training_does(tmp_path, no_cuda):
    """Run.device (eval_outfed.py, fedst.report, fedst.guard, final.json's evaluation) fails on
    a config sized for a GPU with the same one line as training's setup."""
    paper, _ = compose_experiment(["experiment=paper", f"data.root={tmp_path / 'data'}"])
    with pytest.raises(ConfigError) as at_training:
        training.prepare_run(paper, tmp_path / "run")
    with pytest.raises(ConfigError) as at_scoring:
        Run(tmp_path / "run", paper).device  # noqa: B018 (the property resolves the device)
    assert str(at_scoring.value) == str(at_training.value)
    assert "pass train.device=cpu to run it on the CPU anyway" in str(at_scoring.value)
    on_cpu = dataclasses.replace(paper, train=dataclasses.replace(paper.train, device="cpu"))
    assert Run(tmp_path / "run", on_cpu).device == CPU


# -- the facts a run records -----------------------------------------------------------------------


def test_a_run_start_logs_its_device_facts_and_appends_them_to_device_jsonl(tmp_path, caplog):
    cfg, _ = compose_experiment(["experiment=tiny", "train.device=cpu"])
    with caplog.at_level(logging.INFO, logger="fedst.training"):
        training.record_device(cfg, tmp_path)
        training.record_device(cfg, tmp_path)  # a resume adds its own row
    rows = read_jsonl(tmp_path / DEVICE_JSONL)
    assert len(rows) == 2 and rows[0]["role"] == "server"
    row = rows[-1]
    assert row["device"] == "cpu" and row["card"] == accel.device_name(CPU)
    assert row["autocast_dtype"] == "fp32"  # CPU runs never autocast
    assert row["compile"] == str(cfg.train.compile) and row["deterministic"] is False
    assert row["tf32_matmul"] is None and row["cudnn_benchmark"] is None  # not on a CPU
    assert row["torch_version"] == torch.__version__
    lines = [r.getMessage() for r in caplog.records if "device cpu" in r.getMessage()]
    assert len(lines) == 2 and "autocast fp32" in lines[0] and "compile=" in lines[0]


def test_cuda_facts_name_the_card_dtype_tf32_and_autotuning(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    facts = accel.device_facts(CUDA, accel.Precision("cuda", torch.bfloat16), "True")
    assert facts.card == "NVIDIA H100 80GB" and facts.capability == "9.0"
    assert facts.autocast_dtype == "bf16" and facts.compile == "True"
    assert facts.tf32_matmul == torch.backends.cuda.matmul.fp32_precision
    assert facts.cudnn_benchmark == torch.backends.cudnn.benchmark
    line = facts.line()
    assert "device cuda (NVIDIA H100 80GB; compute 9.0, TF32 matmul" in line
    assert "autocast bf16" in line and "compile=True" in line


# -- precision and process-wide switches -----------------------------------------------------------


@pytest.mark.parametrize(
    ("capability", "dtype"), [((7, 5), torch.float16), ((8, 0), torch.bfloat16)]
)
def test_auto_amp_never_picks_emulated_bf16_on_a_pre_ampere_card(monkeypatch, capability, dtype):
    """A Turing card (7.5) emulates bf16 (torch.cuda.is_bf16_supported() says yes by default):
    auto must pick fp16 there; Ampere (8.0) computes bf16 natively."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    assert accel.resolve_precision("auto", CUDA).dtype == dtype


def test_after_configure_device_the_legacy_and_new_tf32_switches_agree():
    """torch >= 2.9 raises when the legacy TF32 state is read after only the per-backend one was
    set; after configure_device both read the same, for TF32 on, off and on again."""
    states = run_child(
        """
        import json, torch
        from fedst import accel
        B = torch.backends
        out = []
        for tf32 in (True, False, True):
            accel.configure_device(torch.device("cuda"), tf32=tf32, cudnn_benchmark=False)
            out.append([B.cuda.matmul.allow_tf32, B.cudnn.allow_tf32,
                        torch.get_float32_matmul_precision(), B.cuda.matmul.fp32_precision,
                        B.cudnn.conv.fp32_precision, B.cudnn.rnn.fp32_precision])
        print(json.dumps(out))
        """
    )
    on = [True, True, "high", "tf32", "tf32", "tf32"]
    off = [False, False, "highest", "ieee", "ieee", "ieee"]
    assert states == [on, off, on]


def test_deterministic_sets_warn_only_algorithms_no_autotuning_and_the_cublas_workspace():
    states = run_child(
        """
        import json, os, torch
        from fedst import accel
        B = torch.backends
        out = []
        for deterministic in (True, False):
            accel.configure_device(torch.device("cuda"), tf32=True, cudnn_benchmark=True,
                                   deterministic=deterministic)
            out.append([torch.are_deterministic_algorithms_enabled(),
                        torch.is_deterministic_algorithms_warn_only_enabled(),
                        B.cudnn.benchmark, B.cudnn.deterministic,
                        os.environ.get("CUBLAS_WORKSPACE_CONFIG")])
        print(json.dumps(out))
        """
    )
    assert states[0] == [True, True, False, True, ":4096:8"]
    off, _warn_only, *rest = states[1]  # warn_only means nothing once the switch is off
    assert [off, *rest] == [False, True, False, ":4096:8"]  # off again; the env var stays
    kept = run_child(
        """
        import json, os, torch
        from fedst import accel
        accel.configure_device(torch.device("cuda"), tf32=True, cudnn_benchmark=True,
                               deterministic=True)
        print(json.dumps(os.environ["CUBLAS_WORKSPACE_CONFIG"]))
        """,
        env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"},
    )
    assert kept == ":16:8"  # a value the user set is kept


def test_on_the_cpu_deterministic_and_tf32_change_nothing():
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    accel.configure_device(CPU, tf32=True, cudnn_benchmark=True, deterministic=True)
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark) == before


# -- GPU memory per phase --------------------------------------------------------------------------


class FakeAllocator:
    """The CUDA caching allocator's counters, driven by hand: ``allocated`` bytes in tensors,
    ``reserved`` bytes held (never below allocated), peaks since the last reset."""

    def __init__(self) -> None:
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def set(self, allocated: int, reserved: int) -> None:
        self.allocated, self.reserved = allocated, reserved
        self.peak_allocated = max(self.peak_allocated, allocated)
        self.peak_reserved = max(self.peak_reserved, reserved)

    def reset(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: self.reset())
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak_allocated)
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: self.peak_reserved)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(memory, "_CUDA_PEAKS_BEFORE_RESETS", [0, 0])


def test_each_phase_reports_its_own_gpu_peaks_and_a_nested_phase_does_not_hide_the_outer_ones(
    monkeypatch,
):
    """The server's "train" phase (in-process: the sites' rounds inside it) peaks at 100 MB in
    its first site; the second site's own phase resets the counters and peaks at 60 MB. The
    outer phase must still report 100, the site 60; the next phase starts from what is held."""
    gpu = FakeAllocator()
    gpu.install(monkeypatch)
    server, site = accel.PhasePeaks(rss=False), accel.PhasePeaks(rss=False)
    gpu.set(20, 30)  # before the round: the model
    with server.phase("train"):
        gpu.set(100, 120)  # site A's round
        gpu.set(20, 120)  # A done: tensors freed, the cache keeps its blocks
        with site.phase("train"):
            gpu.set(60, 120)  # site B's round
            gpu.set(20, 120)
    with server.phase("evaluation"):
        gpu.set(40, 120)
    assert server.row() == {
        "train_cuda_peak_allocated_bytes": 100,
        "train_cuda_peak_reserved_bytes": 120,
        "evaluation_cuda_peak_allocated_bytes": 40,
        "evaluation_cuda_peak_reserved_bytes": 120,
    }
    assert site.reply_metrics("train") == {
        "cuda-peak-allocated-bytes": 60,
        "cuda-peak-reserved-bytes": 120,
    }
    usage = accel.memory_usage()
    assert (usage["cuda_allocated_bytes"], usage["cuda_reserved_bytes"]) == (40, 120)
    assert (usage["cuda_peak_bytes"], usage["cuda_peak_reserved_bytes"]) == (100, 120)  # the run


def test_without_cuda_gpu_memory_is_absent_not_zero(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    peaks = accel.PhasePeaks(rss=False)
    with peaks.phase("train"):
        pass
    assert peaks.row() == {} and peaks.reply_metrics("train") == {}
    assert not any(k.startswith("cuda") for k in accel.memory_usage())


def test_a_sites_gpu_peaks_travel_in_its_reply_into_its_train_row(tmp_path):
    runlog = RunLog(tmp_path, tensorboard=False)
    empty = transport.pack({}, "fp32")
    sizes = {"download_bytes": 0, "download_param_bytes": 0}
    memory = {"cuda-peak-allocated-bytes": 7_000_000_000, "cuda-peak-reserved-bytes": 8 * 2**30}
    on_gpu = train_reply({}, seconds=1.0, **memory)
    reply_logs.log_training_reply(runlog, on_gpu, empty, sizes, 1, 2, None)
    on_cpu = train_reply({}, seconds=1.0)
    reply_logs.log_training_reply(runlog, on_cpu, empty, sizes, 2, 2, None)
    gpu_row, cpu_row = read_jsonl(tmp_path / "train.jsonl")
    assert gpu_row["cuda_peak_allocated_bytes"] == 7_000_000_000
    assert gpu_row["cuda_peak_reserved_bytes"] == 8 * 2**30
    assert not any(k.startswith("cuda") for k in cpu_row)


# -- export ----------------------------------------------------------------------------------------


def test_export_onnx_leaves_the_callers_model_on_its_device_and_in_its_mode(monkeypatch, tmp_path):
    from fedst import export
    from fedst.model.network import NetworkConfig, build_network

    torch.manual_seed(0)
    net = build_network(NetworkConfig(indicator_dim=16, decoder_dim=32, drop_path_rate=0.0))
    net.train()
    indicator = torch.full((16,), 0.25)
    moved = []
    original_to = torch.nn.Module.to

    def spy_to(self, *args, **kwargs):
        moved.append(self)
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", spy_to)
    monkeypatch.setattr(torch.nn.Module, "cpu", lambda self: moved.append(self) or self)
    traced = {}

    class Program:
        def save(self, path):
            Path(path).write_bytes(b"onnx")

    def fake_export(step, inputs, **kwargs):
        traced["step"] = step
        return Program()

    monkeypatch.setattr(torch.onnx, "export", fake_export)
    params = {k: v.data_ptr() for k, v in net.state_dict().items()}
    export.export_onnx(net, indicator, (32, 40), 0.2, tmp_path / "a.onnx")
    assert net.training  # the caller's mode
    assert not any(m is net or any(m is c for c in net.modules()) for m in moved)
    assert {k: v.data_ptr() for k, v in net.state_dict().items()} == params
    exported = traced["step"].net
    assert exported is not net and not exported.training
    assert all(p.device == CPU for p in exported.parameters())
    for (key, mine), theirs in zip(
        net.state_dict().items(), exported.state_dict().values(), strict=True
    ):
        assert torch.equal(mine, theirs), key


def test_the_tiny_experiment_of_the_equality_tests_asks_for_deterministic_algorithms():
    """The resume and engine-equality tests run the tiny experiment on train.device=auto: on a
    GPU they compare bit for bit only with deterministic algorithms (a no-op on the CPU)."""
    tiny, _ = compose_experiment(["experiment=tiny"])
    assert tiny.train.deterministic and tiny.train.device == "auto"
    paper, _ = compose_experiment(["experiment=paper"])
    assert not paper.train.deterministic  # the paper's run keeps cuDNN autotuning

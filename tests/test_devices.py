"""Specification of device choices: mixed precision and step helpers (fedst/accel/), Ray's
per-site CPU / GPU shares, loader workers ("auto") and the config fields that hold them. CPU only:
GPU facts (device count, bf16 support) are given to the functions or mocked."""

from __future__ import annotations

import json

import pytest
import torch

from fedst import accel
from fedst.cli import compose_experiment
from fedst.config import ConfigError, build
from fedst.data import clips
from fedst.experiment import RayConfig, TrainConfig, experiment_from_json
from fedst.training import ray_client_resources

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


# -- mixed precision -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("amp_dtype", "device", "bf16_supported", "dtype", "scaler"),
    [
        ("auto", CUDA, True, torch.bfloat16, False),
        ("auto", CUDA, False, torch.float16, True),
        ("bf16", CUDA, False, torch.bfloat16, False),
        ("fp16", CUDA, True, torch.float16, True),
        ("none", CUDA, True, None, False),
        ("auto", CPU, True, None, False),
        ("fp16", CPU, True, None, False),
        ("bf16", CPU, True, None, False),
    ],
)
def test_each_amp_setting_resolves_to_its_dtype_and_scaler(
    amp_dtype, device, bf16_supported, dtype, scaler
):
    precision = accel.resolve_precision(amp_dtype, device, bf16_supported=bf16_supported)
    assert precision.dtype == dtype
    assert precision.enabled == (dtype is not None)
    assert precision.needs_scaler == scaler
    if not scaler:
        assert precision.grad_scaler() is None


def test_fp16_gets_a_grad_scaler_and_an_unknown_dtype_is_an_error():
    precision = accel.Precision("cpu", torch.float16)  # the scaler's own logic, built on CPU
    assert isinstance(precision.grad_scaler(), torch.amp.GradScaler)
    with pytest.raises(ValueError, match=r"train\.amp_dtype='fp8'"):
        accel.resolve_precision("fp8", CPU)
    with pytest.raises(ConfigError, match=r"train\.amp_dtype='fp8'"):
        TrainConfig(amp_dtype="fp8")


def test_fp32_autocast_is_a_no_op_and_bf16_autocast_casts():
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with accel.Precision("cpu").autocast():
        assert layer(x).dtype == torch.float32
    with accel.Precision("cpu", torch.bfloat16).autocast():
        assert layer(x).dtype == torch.bfloat16


def test_cpu_device_settings_change_nothing_and_fuse_nothing():
    before = (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.fp32_precision)
    accel.configure_device(CPU, tf32=True, cudnn_benchmark=True)
    assert (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.fp32_precision) == before
    assert accel.fused_optimizer_options(CPU) == {}
    assert accel.fused_optimizer_options(CUDA) == {"fused": True}


def test_compile_is_in_place_and_only_when_asked(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: calls.append((self, k)))
    model = torch.nn.Linear(2, 2)
    assert accel.maybe_compile(model, "none") is model and calls == []
    assert accel.maybe_compile(model, "default") is model and calls == [
        (model, {"mode": "default"})
    ]
    assert list(model.state_dict()) == ["weight", "bias"]  # no _orig_mod. prefix


def test_optimizer_step_with_a_scaler_equals_the_plain_step_and_clips():
    """A GradScaler step (unscale, clip, step) gives the plain clipped step's parameters."""
    results = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=1024.0)):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(5, 3)).pow(2).sum() * 100
        accel.optimizer_step(loss, optimizer, scaler, model.parameters(), max_grad_norm=1.0)
        results.append([p.detach().clone() for p in model.parameters()])
    for plain, scaled in zip(*results, strict=True):
        assert torch.allclose(plain, scaled, atol=1e-6)


def test_the_loss_log_returns_every_loss_once_and_finds_the_first_non_finite():
    log = accel.LossLog()
    for value in (1.0, 2.5, float("nan"), float("inf")):
        log.append(torch.tensor(value, requires_grad=True) * 1)
    values = log.values()
    assert values[:2] == [1.0, 2.5] and len(log) == 4
    assert accel.first_non_finite(values) == 2
    assert accel.first_non_finite([0.5]) is None
    assert accel.LossLog().values() == []


def test_train_amp_of_a_saved_config_reads_as_amp_dtype():
    cfg, _ = compose_experiment(["experiment=tiny"])
    values = json.loads(cfg.to_json())
    for old, new in ((True, "bf16"), (False, "none")):
        train = {k: v for k, v in values["train"].items() if k != "amp_dtype"}
        saved = {**values, "train": {**train, "amp": old}}
        assert experiment_from_json(json.dumps(saved)).train.amp_dtype == new
    assert TrainConfig(amp_dtype="none").amp is False and TrainConfig().amp is True


# -- Ray's per-site resources ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "sites", "share"),
    [(0, 4, 0.0), (1, 4, 0.25), (2, 4, 0.5), (3, 4, 0.75), (4, 4, 1.0), (8, 4, 1.0), (1, 1, 1.0)],
)
def test_the_automatic_gpu_share_of_a_site_follows_the_gpu_count(monkeypatch, gpus, sites, share):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    resources = ray_client_resources(RayConfig(), sites, cpu_count=8)
    assert resources == {"num_cpus": float(max(1, 8 // sites)), "num_gpus": share}


def test_configured_shares_are_used_as_given(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    ray = build(RayConfig, {"num_cpus_per_site": 3, "num_gpus_per_site": 0.5}, "ray")
    assert ray_client_resources(ray, 4, cpu_count=2) == {"num_cpus": 3.0, "num_gpus": 0.5}
    assert ray_client_resources(RayConfig(), 4, cpu_count=2)["num_cpus"] == 1.0  # at least one
    with pytest.raises(ConfigError, match=r"ray\.num_gpus_per_site='half'"):
        build(RayConfig, {"num_gpus_per_site": "half"}, "ray")
    with pytest.raises(ConfigError, match=r"ray\.num_cpus_per_site=0"):
        RayConfig(num_cpus_per_site=0)


def test_the_ray_engine_passes_the_resolved_shares_to_flower(monkeypatch, tmp_path):
    """run_training(engine="ray") hands Flower's run_simulation the configured GPU share (2
    GPUs mocked, 4 tiny sites: 0.5 each) instead of the former fixed 0 GPUs."""
    import flwr.simulation

    from fedst import training

    seen = {}

    def run_simulation(**kwargs):
        seen.update(kwargs)
        raise SystemExit  # stop before any round: only the resources are checked here

    monkeypatch.setattr(flwr.simulation, "run_simulation", run_simulation)
    monkeypatch.setattr(training, "require_ray", lambda: None)  # Flower's simulation is mocked
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(training, "prepare_run", lambda *args, **kwargs: None)
    monkeypatch.setattr(training, "make_server_app", lambda *args, **kwargs: None)
    cfg, _ = compose_experiment(["experiment=tiny", f"data.root={tmp_path}"])
    with pytest.raises(SystemExit):
        training.run_training(cfg, tmp_path / "run", engine="ray", progress=False)
    sites = seen["num_supernodes"]
    assert seen["backend_config"]["client_resources"]["num_gpus"] == min(1.0, 2 / sites)


# -- loader workers --------------------------------------------------------------------------------


@pytest.mark.parametrize(("cores", "workers"), [(1, 0), (2, 1), (3, 2), (5, 4), (8, 4), (64, 4)])
def test_auto_workers_of_a_lone_loader_leave_one_core_and_stop_at_four(monkeypatch, cores, workers):
    monkeypatch.setattr(clips.loaders, "usable_cpu_count", lambda: cores)
    assert clips.resolve_num_workers("auto") == workers
    assert clips.resolve_num_workers(3) == 3


def test_worker_counts_are_numbers_or_auto():
    assert TrainConfig().num_workers == "auto"
    with pytest.raises(ConfigError, match=r"train\.num_workers='many'"):
        TrainConfig(num_workers="many")
    with pytest.raises(ConfigError, match=r"train\.num_workers=-1"):
        TrainConfig(num_workers=-1)
    with pytest.raises(ValueError, match="num_workers='many'"):
        clips.resolve_num_workers("many")


def test_distances_are_computed_every_k_rounds_and_at_the_last():
    every_two = TrainConfig(rounds=5, distance_metrics_every=2)
    assert [r for r in range(1, 6) if every_two.distances_at(r)] == [2, 4, 5]
    last_only = TrainConfig(rounds=5, distance_metrics_every=None)
    assert [r for r in range(1, 6) if last_only.distances_at(r)] == [5]
    assert all(TrainConfig(rounds=5).distances_at(r) for r in range(1, 6))  # default: every one
    assert last_only.evaluation_options()["distances"]  # a final evaluation always has them
    assert not last_only.evaluation_options(3)["distances"]

"""Specification of the prepared GPU check (bench/gpu_check/check.py, bench/gpu_check/gpu_check.sh): the wheels it
carries, its report written after every step, its time limits, and the whole script on the CPU.
The device tests compare ``test_device`` ($FEDST_TEST_DEVICE, cuda in the GPU check) with the CPU;
on the CPU alone they are skipped."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from bench.gpu_check import check as gpu_check
from bench.gpu_check import plan as gpu_check_plan
from bench.gpu_check import runner as check_runner
from bench.gpu_check import schedule as gpu_schedule
from bench.gpu_check import timing as gpu_timing
from bench.gpu_check import wheels as gpu_wheels
from fedst import accel
from fedst.experiment import TrainConfig
from fedst.model.losses import SegmentationLoss
from fedst.model.network import NetworkConfig, build_network

REPO = Path(__file__).resolve().parents[1]
SMALL = NetworkConfig(indicator_dim=8, decoder_dim=32, drop_path_rate=0.0)
NEEDS_A_GPU = "compares the test device with the CPU: run with FEDST_TEST_DEVICE=cuda on a GPU"


# -- on the test device (cuda in the GPU check) ----------------------------------------------------


def _fp32_exact(device: torch.device) -> None:
    if device.type == "cuda":
        accel.set_tf32(False)  # both of PyTorch's switches (the new ones alone upset compile)


def test_a_training_step_on_the_test_device_gives_the_cpu_s_loss_and_gradients(test_device):
    if test_device.type == "cpu":
        pytest.skip(NEEDS_A_GPU)
    _fp32_exact(test_device)
    torch.manual_seed(0)
    net = build_network(SMALL).train()
    clips = torch.randn(2, net.cfg.num_frames, 3, 64, 80)
    target = torch.randint(0, net.cfg.num_classes, (2, 64, 80))
    indicator = torch.randn(8)
    results = []
    for device in (torch.device("cpu"), test_device):
        model = build_network(SMALL).train().to(device)
        model.load_state_dict(net.state_dict())
        loss = SegmentationLoss(num_classes=net.cfg.num_classes)(
            model(clips.to(device), indicator.to(device)), target.to(device)
        )
        loss.backward()
        grads = torch.cat(
            [p.grad.flatten().cpu() for p in model.parameters() if p.grad is not None]
        )
        results.append((loss.item(), grads))
    (cpu_loss, cpu_grads), (dev_loss, dev_grads) = results
    assert dev_loss == pytest.approx(cpu_loss, rel=1e-4)
    assert torch.allclose(dev_grads, cpu_grads, rtol=1e-3, atol=1e-5)


def test_streaming_on_the_test_device_gives_the_cpu_s_logits(test_device):
    if test_device.type == "cpu":
        pytest.skip(NEEDS_A_GPU)
    _fp32_exact(test_device)
    torch.manual_seed(0)
    net = build_network(SMALL).eval()
    frames, indicator = torch.randn(6, 1, 3, 64, 80), torch.randn(8)
    on_device = build_network(SMALL).eval().to(test_device)
    on_device.load_state_dict(net.state_dict())
    cpu_stream = net.stream(indicator, interval_s=0.2)
    device_stream = on_device.stream(indicator.to(test_device), interval_s=0.2)
    for index, frame in enumerate(frames):
        expected = cpu_stream.step(frame, index * 0.1)
        got = device_stream.step(frame.to(test_device), index * 0.1).cpu()
        assert torch.allclose(got, expected, atol=1e-4), f"frame {index}"


# -- the wheels ------------------------------------------------------------------------------------


def test_the_wheel_plan_descends_only_into_packages_the_gpu_machine_lacks():
    # hydra-core 1.3.8 needs omegaconf, antlr4-python3-runtime 4.9.* and packaging; omegaconf
    # needs antlr4 and PyYAML (their METADATA): with packaging and PyYAML on the machine, the
    # three others travel, and protobuf and typing-extensions always do (gpu_wheels.CARRIED_ANYWAY)
    plan = gpu_wheels.wheel_plan(["hydra-core==1.3.8"], present=frozenset({"packaging", "pyyaml"}))
    assert set(plan) == {
        "hydra-core",
        "omegaconf",
        "antlr4-python3-runtime",
        *gpu_wheels.CARRIED_ANYWAY,
    }
    assert set(gpu_wheels.CARRIED_ANYWAY) == {"protobuf", "typing-extensions"}
    assert plan["hydra-core"] == "1.3.8" and plan["antlr4-python3-runtime"].startswith("4.9.")
    # a package the machine has is not expanded: omegaconf's own needs do not travel either
    plan = gpu_wheels.wheel_plan(["hydra-core==1.3.8"], present=frozenset({"omegaconf"}))
    assert "pyyaml" not in plan and "antlr4-python3-runtime" in plan  # hydra's own need


def test_fedst_s_wheel_plan_holds_what_the_gpu_machine_lacks_and_never_torch():
    try:
        metadata.requires("fedst")
    except metadata.PackageNotFoundError:
        pytest.skip(
            "reads fedst's installed metadata (make venv); the GPU check puts it on PYTHONPATH"
        )
    plan = gpu_wheels.wheel_plan()
    for needed in ("flwr", "hydra-core", "omegaconf", "monai", "albumentations", "open-clip-torch"):
        assert needed in plan
    for present in ("torch", "torchvision", "numpy", "timm", "onnxruntime", "pytest", "fedst"):
        assert present not in plan
    assert plan["flwr"] == "1.41.0"


@pytest.mark.parametrize(
    ("wheel", "installable"),
    [
        ("a-1.0-py3-none-any.whl", True),
        ("b-1.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", True),
        ("c-1.0-cp311-abi3-manylinux_2_34_x86_64.whl", True),  # the stable ABI, from 3.11 on
        ("d-1.0-cp311-cp311-manylinux_2_17_x86_64.whl", False),  # another Python
        ("e-1.0-cp312-cp312-macosx_11_0_arm64.whl", False),  # another platform
        ("f-1.0-cp312-cp312-manylinux_2_17_aarch64.whl", False),  # another processor
    ],
)
def test_only_wheels_for_cpython_3_12_on_x86_64_linux_pass_the_gpu_machine_check(
    wheel, installable
):
    assert gpu_wheels.incompatible_wheels([Path(wheel)]) == ([] if installable else [wheel])


# -- the driver ------------------------------------------------------------------------------------


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_report_is_written_after_every_step_and_a_hung_step_is_cut_off(tmp_path, monkeypatch):
    out = tmp_path / "out"
    report = out / "gpu_check.json"
    # step 2 succeeds only if step 1's result is already in the report when step 2 starts
    reads_report = (
        f"import json, sys; steps = json.load(open({str(report)!r}))['steps']; "
        "sys.exit(0 if [s['status'] for s in steps] == ['ok'] else 1)"
    )
    steps = [
        check_runner.Step("first", "first", 30, [_python("pass")], collect=lambda: {"x": 1}),
        check_runner.Step("second", "reads the report", 30, [_python(reads_report)]),
        check_runner.Step("hangs", "sleeps", 2, [_python("import time; time.sleep(60)")]),
        check_runner.Step("last", "after the hung one", 30, [_python("pass")]),
    ]
    monkeypatch.setattr(gpu_check, "plan_steps", lambda *args: steps)
    results = gpu_check.run_check(cpu=True, out=out, budget_s=60)
    assert [r.status for r in results] == ["ok", "ok", "timeout", "ok"]
    assert results[2].seconds < 10
    written = json.loads(report.read_text())
    assert [s["status"] for s in written["steps"]] == ["ok", "ok", "timeout", "ok"]
    assert written["steps"][0]["metrics"] == {"x": 1}
    assert "| hangs | timeout |" in (out / "gpu_check.md").read_text()


def test_a_step_past_the_overall_budget_is_not_run(tmp_path, monkeypatch):
    steps = [
        check_runner.Step("slow", "slow", 30, [_python("import time; time.sleep(3)")]),
        check_runner.Step("late", "late", 30, [_python("pass")]),
    ]
    monkeypatch.setattr(gpu_check, "plan_steps", lambda *args: steps)
    results = gpu_check.run_check(cpu=True, out=tmp_path, budget_s=6)
    assert [r.status for r in results] == ["ok", "not run"]


def test_the_steps_files_are_removed_at_the_end_unless_kept(tmp_path, monkeypatch):
    # each step leaves a file in the work directory plan_steps was given (the real ones: 1.7 GB)
    planned: list[Path] = []

    def plan(device, sizes, work):
        planned.append(work)
        touch = f"open({str(work / 'left.bin')!r}, 'wb').write(b'x')"
        return [check_runner.Step("writes", "writes a file", 30, [_python(touch)])]

    monkeypatch.setattr(gpu_check, "plan_steps", plan)
    results = gpu_check.run_check(cpu=True, out=tmp_path / "out", budget_s=30)
    assert [r.status for r in results] == ["ok"]
    assert not planned[0].exists()
    kept = tmp_path / "kept"
    gpu_check.run_check(cpu=True, out=tmp_path / "out", budget_s=30, keep_work=kept)
    assert planned[1] == kept and (kept / "left.bin").exists()


def test_an_option_this_checkout_lacks_makes_its_step_unsupported(tmp_path, monkeypatch):
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    fields.pop("channels_last", None)
    monkeypatch.setattr(gpu_check_plan, "_config_fields", lambda: fields)
    steps = {
        s.name: s for s in gpu_check_plan.plan_steps("cpu", gpu_check_plan.CPU_SIZES, tmp_path)
    }
    assert "channels_last" in (steps["paper_scale_options"].unsupported or "")
    assert steps["paper_scale_baseline"].unsupported is None  # the baseline just leaves it out
    assert not any("channels_last" in a for a in steps["paper_scale_baseline"].commands[0])
    fields["channels_last"] = False
    monkeypatch.setattr(gpu_check_plan, "_config_fields", lambda: fields)
    steps = {
        s.name: s for s in gpu_check_plan.plan_steps("cpu", gpu_check_plan.CPU_SIZES, tmp_path)
    }
    assert steps["paper_scale_options"].unsupported is None


# -- budget, pre-flight, exit status, TF32 ------------------------------------------------------


def test_the_steps_run_by_value_and_their_limits_fit_the_gpu_budget_with_a_margin():
    steps = gpu_check_plan.plan_steps("cuda", gpu_check_plan.GPU_SIZES, Path("/nonexistent"))
    names = [s.name for s in steps]
    assert names == ["facts", "federation", "schedule", "tests", "scoring", "step", "stream"]
    # every step gets its whole limit inside the budget, so none is "not run" for lack of time
    assert sum(s.timeout_s for s in steps) <= gpu_check_plan.GPU_SIZES.budget_s
    # the budget, the wheels and pre-flight inside the device call's limit (at most 600 s), and
    # with a machine's start (up to 2 minutes) the 15-minute lease keeps the 4 minutes a second
    # call needs
    assert gpu_check_plan.GPU_SIZES.budget_s + 30 <= gpu_check_plan.RUN_TIMEOUT_S <= 600
    assert gpu_check_plan.RUN_TIMEOUT_S + 120 <= 15 * 60 - 4 * 60
    assert all(s.measures for s in steps), "the report says what each step measures"


def test_only_tests_that_run_on_cuda_are_in_the_gpu_check_s_test_step():
    for node in gpu_check_plan.GPU_TEST_FILES:
        text = (REPO / node.split("::")[0]).read_text()
        assert "test_device" in text or "cuda" in text.lower(), node
    assert "tests/test_device_scoring.py" in gpu_check_plan.GPU_TEST_FILES


def test_without_a_usable_gpu_the_check_stops_in_seconds_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "sees no GPU" in gpu_check.preflight("cuda")
    assert gpu_check.preflight("cpu") is None
    if torch.cuda.is_available():
        return
    # this machine has no GPU: the script itself must say so and exit 3 before any step
    env = {**os.environ, "OUT": str(tmp_path)}
    env.pop("FEDST_TEST_DEVICE", None)
    done = subprocess.run(["bash", "bench/gpu_check/gpu_check.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    assert "no usable cuda device" in done.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_the_check_exits_non_zero_when_a_step_fails(tmp_path, monkeypatch):
    steps = [
        check_runner.Step("fine", "fine", 30, [_python("pass")]),
        check_runner.Step("broken", "exits 1", 30, [_python("raise SystemExit(1)")]),
    ]
    monkeypatch.setattr(gpu_check, "plan_steps", lambda *args: steps)
    assert gpu_check.main(["run", "--cpu", "--out", str(tmp_path), "--budget-s", "60"]) == 1
    steps.pop()
    assert gpu_check.main(["run", "--cpu", "--out", str(tmp_path), "--budget-s", "60"]) == 0


def test_tf32_goes_through_fedst_s_one_setter(monkeypatch):
    calls = []
    monkeypatch.setattr(accel, "set_tf32", calls.append)
    gpu_timing._set_tf32(torch.device("cuda"), True)
    gpu_timing._set_tf32(torch.device("cuda"), False)
    gpu_timing._set_tf32(torch.device("cpu"), True)  # nothing to set on the CPU
    assert calls == [True, False]


def test_p95_shows_the_slow_frames_the_median_hides():
    # 19 frames of 10 ms and one of 100 ms: p50 10 ms, p95 (index round(0.95 x 19) = 18 of the
    # sorted 20) still 10 ms; two slow frames of 20 put 100 ms at p95
    seconds = [0.01] * 18 + [0.1, 0.1]
    summary = gpu_timing.frame_time_summary(seconds)
    assert summary["ms_p50"] == pytest.approx(10.0) and summary["ms_p95"] == pytest.approx(100.0)
    assert summary["fps"] == pytest.approx(100.0) and summary["fps_p95"] == pytest.approx(10.0)


# -- what the GPU machine has ---------------------------------------------------------------------


def test_a_carried_package_that_needs_more_than_the_machine_has_is_named():
    # omegaconf 2.3 needs PyYAML >= 5.1.0 (its METADATA), which the machine has: a machine with
    # PyYAML 5.0 would fail the import of omegaconf, so of hydra and every run
    plan = gpu_wheels.wheel_plan(["hydra-core==1.3.8"])
    assert "omegaconf" in plan and "pyyaml" not in plan
    unmet, _ = gpu_wheels.unmet_on_the_gpu_machine(plan, known={"pyyaml": "5.0"})
    assert any(line.startswith("omegaconf needs PyYAML>=5.1") for line in unmet), unmet
    assert not gpu_wheels.unmet_on_the_gpu_machine(plan, known={"pyyaml": "6.0.2"})[0]
    unmet, unknown = gpu_wheels.unmet_on_the_gpu_machine(plan, known={})
    assert not unmet and any(line.startswith("omegaconf needs PyYAML") for line in unknown)


def test_the_requirement_report_names_an_unmet_requirement_on_pythonpath(tmp_path):
    info = tmp_path / "needs_future_numpy-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: needs-future-numpy\nVersion: 1.0\n"
        "Requires-Dist: numpy>=99\nRequires-Dist: surely-not-installed-pkg\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "requirements"], cwd=REPO,
                          env=env, capture_output=True, text=True, check=True)  # fmt: skip
    lines = done.stdout.splitlines()
    numpy_version = metadata.version("numpy")
    assert f"needs-future-numpy 1.0: needs numpy>=99, installed {numpy_version}" in lines
    assert "needs-future-numpy 1.0: needs surely-not-installed-pkg, not installed" in lines


# -- the schedule's arithmetic (bench/gpu_check/schedule.py) -------------------------------------


def test_the_round_fit_recovers_the_fixed_and_per_iteration_cost():
    exact = gpu_schedule.fit_round_cost([(5, 0.7 + 5 * 0.12), (20, 0.7 + 20 * 0.12), (60, 7.9)])
    assert exact["F_s"] == pytest.approx(0.7) and exact["t_s"] == pytest.approx(0.12)
    assert exact["max_residual_s"] == pytest.approx(0.0, abs=1e-12)
    # one round 0.3 s slow: the line through the others moves, and the residual says so
    noisy = gpu_schedule.fit_round_cost([(5, 1.3 + 0.3), (20, 3.1), (60, 7.9)])
    assert noisy["max_residual_s"] > 0.1
    with pytest.raises(ValueError, match="two distinct"):
        gpu_schedule.fit_round_cost([(20, 1.0), (20, 1.1)])


def test_the_paper_schedule_lists_each_term_of_the_issue_s_formula():
    hours = gpu_schedule.paper_schedule(1.0, 0.1, 0.2, 0.01, 0.05)
    # by hand: 300 x 4 x (1 + 100 x 0.1) s; 300 x 100 x 0.2 s; 30 x 3718 x 0.01 s; 3000 x 0.05 s
    assert hours["sites_h"] == pytest.approx(13200 / 3600)
    assert hours["site_fixed_h"] == pytest.approx(1200 / 3600)
    assert hours["serq_h"] == pytest.approx(6000 / 3600)
    assert hours["evaluation_h"] == pytest.approx(1115.4 / 3600)
    assert hours["pretraining_h"] == pytest.approx(150 / 3600)
    assert hours["total_h"] == pytest.approx((13200 + 6000 + 1115.4 + 150) / 3600)


# -- the whole script, as the GPU machine runs it --------------------------------------------------


@pytest.mark.slow  # about 10 minutes on 2 cores: `pytest -m slow tests/test_gpu_check.py`
def test_the_rehearsal_runs_every_step_ok_with_the_dependencies_on_pythonpath_only(tmp_path):
    """bench/gpu_check/rehearsal.py: a bare environment with the GPU machine's packages, FedST's other
    dependencies as wheels on PYTHONPATH alone, then ``bash bench/gpu_check/gpu_check.sh --cpu``."""
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FEDST_TEST_DEVICE", None)
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check.rehearsal", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=2400,
        check=False,
    )
    report = json.loads((out / "gpu_check.json").read_text())
    statuses = {s["name"]: (s["status"], s["note"]) for s in report["steps"]}
    expected = {
        "facts",
        "federation",
        "schedule",
        "paper_scale",
        "tests",
        "scoring",
        "step",
        "stream",
        "paper_scale_baseline",
        "paper_scale_options",
    }
    assert set(statuses) == expected
    for name, (status, note) in statuses.items():
        assert status == "ok", f"{name}: {status} {note}"
    assert done.returncode == 0, done.stderr[-3000:]
    # FedST's dependencies came from the wheels on PYTHONPATH, not from an installed copy
    facts = {s["name"]: s["metrics"] for s in report["steps"]}["facts"]
    assert facts["device"] == "cpu"
    site = str(REPO / ".rehearsal" / "site")
    assert facts["imported_from"]["flwr"] == site and facts["imported_from"]["hydra"] == site
    assert facts["imported_from"]["torch"] != site  # the machine's own (here: linked from .venv)
    assert "flwr==1.41.0" in (out / "pip_list.txt").read_text()
    markdown = (out / "gpu_check.md").read_text()
    assert all(f"| {name} | ok |" in markdown for name in expected)
    steps = {s["name"]: s["metrics"] for s in report["steps"]}
    assert steps["federation"]["train.device"] == "cpu" and steps["federation"]["infer_frames"] >= 1
    paper_scale = steps["paper_scale"]
    assert paper_scale["device_facts"]["device"] == "cpu"
    assert paper_scale["gpu_busy_rounds"] == [2]  # 4 rounds: 1 warms up, 3 evaluates, 4 is last
    assert paper_scale["evaluation_rounds"] == [3]
    assert "after warm-up" in paper_scale["pretrain_measure"]
    schedule = steps["schedule"]  # on the CPU: eager only, CUDA-only figures not faked
    assert schedule["not_run"] == {m: gpu_schedule.NO_CUDA for m in ("default", "reduce-overhead")}
    eager = schedule["modes"]["none"]
    assert [r["iters"] for r in eager["site"]["rounds"]] == [3, 5, 20, 60]
    assert eager["site"]["t_s"] > 0 and eager["site"]["evaluation"]["frames"] > 0
    for figure in ("busy", "cuda_event_step_ms", "sync_debug_error_mode"):
        assert eager["site"][figure] == gpu_schedule.NO_CUDA
    assert eager["server"]["serq_s_per_batch"] > 0 and eager["server"]["pretrain_s_per_iter"] > 0
    assert eager["paper_schedule_h"]["total_h"] > eager["paper_schedule_h"]["sites_h"] > 0
    assert steps["scoring"]["scores_equal"] is True
    assert (
        steps["step"]["variants"]["baseline: fp32, no TF32, eager, contiguous"]["ms_per_step"] > 0
    )
    stream = steps["stream"]["variants"]
    assert stream["eager fp32"]["max_abs_diff_vs_eager_fp32"] == 0.0
    assert all(v["ms_p95"] >= v["ms_p50"] for v in stream.values() if v["status"] == "ok")

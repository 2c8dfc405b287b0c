"""One device rule for every command that scores a finished run (issue 63): eval_outfed.py takes
train_fed.py's ``train.device=``, the report (fedst.report) and the guard (fedst.guard) take
``--device``; each resolves it as training does (fedst.experiment.run_device: a run sized for a
GPU, ``train.require_gpu``, refuses a silent CPU fallback and names the override in its fix)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fedst.config import ConfigError
from fedst.runs.device_option import device_run
from fedst.runs.layout import CONFIG_JSON, outfed_result
from tests.conftest import REPO

CPU = torch.device("cpu")


@pytest.fixture
def gpu_sized_run(tiny_run, tmp_path, monkeypatch):
    """A copy of the session's tiny run whose config.json says train.require_gpu=true, on a
    machine without CUDA (as far as torch can tell)."""
    _, run_dir, _ = tiny_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    config = json.loads((copy / CONFIG_JSON).read_text())
    assert config["train"]["device"] == "auto"
    config["train"]["require_gpu"] = True
    (copy / CONFIG_JSON).write_text(json.dumps(config))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return copy


def test_eval_outfed_refuses_a_gpu_sized_run_without_cuda_and_scores_it_with_train_device_cpu(
    gpu_sized_run, in_process
):
    command = ["eval_outfed.py", f"run={gpu_sized_run}", "sites=[E]", "max_frames=1"]
    refused = in_process([*command, "progress=false"], REPO)
    assert refused.returncode == 2, refused.stderr
    assert "train.device=auto found no CUDA device" in refused.stderr
    assert "pass train.device=cpu to run it on the CPU anyway" in refused.stderr
    assert not outfed_result(gpu_sized_run, "_E").exists()
    scored = in_process([*command, "progress=false", "train.device=cpu"], REPO)
    assert scored.returncode == 0, scored.stderr[-2000:]
    assert outfed_result(gpu_sized_run, "_E").is_file()


def test_the_report_and_the_guard_resolve_device_by_training_s_rule_naming_their_option(
    gpu_sized_run, in_process, tmp_path
):
    refused = in_process(
        ["-m", "fedst.report", "matrix", str(gpu_sized_run), "--out", str(tmp_path / "m")], REPO
    )
    assert refused.returncode != 0
    assert "--device=auto found no CUDA device" in refused.stderr
    assert "pass --device=cpu to run it on the CPU anyway" in refused.stderr
    with pytest.raises(ConfigError, match="pass --device=cpu"):
        device_run(gpu_sized_run, None).device  # noqa: B018 (the property resolves the device)
    assert device_run(gpu_sized_run, "cpu").device == CPU  # what --device cpu reads
    for command in (["fedst.guard", str(gpu_sized_run)], ["fedst.report", "msf", "x"]):
        wrong = in_process(["-m", *command, "--device", "tpu"], REPO)
        assert wrong.returncode == 2
        assert "--device='tpu'; choose auto, cpu, cuda or cuda:N" in wrong.stderr

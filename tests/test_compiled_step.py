"""Specification: a training iteration compiled by ``train.compile`` (fedst.accel.CompiledStep:
forward, loss and backward through ``torch.compile``, the fused optimizer beside it, inputs in
static buffers) computes what the eager iteration computes, from a model that never ran eagerly
(issue 60, item 2).

What the CPU can show: Inductor's ``default`` mode, in fp32 and under bf16 autocast, against the
same iteration run eagerly on a deep copy of the same cold model, over two iterations on different
batches (a step that read a stale or uninitialised input buffer differs at the second). CUDA
graphs (``reduce-overhead``) exist on CUDA only: the GPU check compiles the site step in that mode
(bench/gpu_check). The model here is small (a strided conv stem, CFFM's temporal block at 1/4 of
16 channels, a 1x1 head: Inductor compiles its forward and backward in seconds here, where the
tiny FedSTNet's took 11 min on this machine under load); the site's own step from a cold FedSTNet
is the slow test at the end.

Tolerances (an independent bound, not fitted): fp32, Inductor reorders reductions only: loss and
every gradient within 1e-4 relative (of its own norm, or of 1e-3 of the model's gradient norm
where it is smaller: :data:`GRADIENT_FLOOR`). bf16: Inductor keeps fused
intermediates in fp32 where eager rounds each op's output to bf16 (8 bits of mantissa, a relative
step of 2^-8 = 0.4 % per rounding); loss within 2 % and each gradient within 10 % of its norm, the
direction within cosine 0.99.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedst.accel import CompiledStep, Precision, optimizer_step
from fedst.data.procedural import generate
from fedst.federation import site as site_module
from fedst.federation.site import Site
from fedst.methods import LocalPhase
from fedst.model import FedSTNet
from fedst.model.losses import SegmentationLoss
from fedst.model.temporal_cffm import CFFMTemporalBlock
from tests.test_federation import experiment

pytestmark = pytest.mark.usefixtures("single_torch_thread")

CPU = torch.device("cpu")
CLASSES, FRAMES, SIZE = 4, 4, (32, 40)
TOLERANCES = {"fp32": (1e-4, 1e-4, 1.0 - 1e-6), "bf16": (2e-2, 0.1, 0.99)}
"""precision -> (loss, relative gradient error, least gradient cosine)."""


class SmallSegmenter(nn.Module):
    """clips [B, T, 3, H, W] -> logits [B, CLASSES, H, W]: a conv stem at 1/4, CFFM's temporal
    block over the T frames' maps, a 1x1 head, bilinear upsampling."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, stride=4, padding=1)
        self.temporal = CFFMTemporalBlock(channels, 1, mlp_ratio=2.0)
        self.head = nn.Conv2d(channels, CLASSES, 1)

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        b, t = clips.shape[:2]
        maps = F.gelu(self.stem(clips.flatten(0, 1))).unflatten(0, (b, t))  # [B, T, c, h, w]
        fused = self.temporal([maps[:, i] for i in range(t)])  # [B, c, h, w]
        return F.interpolate(self.head(fused), size=clips.shape[-2:], mode="bilinear")


def iteration(model: nn.Module, precision: Precision, loss_fn: SegmentationLoss):
    def objective(clips: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        with precision.autocast():
            logits = model(clips)
        return loss_fn(logits.float(), masks)

    return objective


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(2, FRAMES, 3, *SIZE, generator=generator),
            torch.randint(0, CLASSES, (2, *SIZE), generator=generator),
        )
        for _ in range(count)
    ]


def cold_model() -> SmallSegmenter:
    torch.manual_seed(0)
    model = SmallSegmenter()
    model.temporal.prepare(SIZE[0] // 4, SIZE[1] // 4)  # the layout, eagerly (never run)
    return model


GRADIENT_FLOOR = 1e-3
"""Gradients below this fraction of the whole model's gradient norm are compared against that
floor, not their own norm: an attention key's bias has an exactly zero gradient in exact
arithmetic (softmax ignores a shift shared by all keys), so its computed value is rounding noise
whose relative error means nothing."""


def gradient_errors(compiled: nn.Module, eager: nn.Module) -> dict[str, tuple[float, float]]:
    """Parameter name -> (|compiled - eager| / max(|eager|, floor), cosine; 1.0 under the
    floor) of every gradient."""
    pairs = [
        (name, p.grad.flatten().double(), q.grad.flatten().double())
        for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True)
    ]
    floor = GRADIENT_FLOOR * float(torch.cat([e for _, _, e in pairs]).norm())
    errors = {}
    for name, c, e in pairs:
        norm = float(e.norm())
        cosine = float(F.cosine_similarity(c, e, dim=0)) if norm > floor else 1.0
        errors[name] = (float((c - e).norm()) / max(norm, floor), cosine)
    return errors


@pytest.mark.slow  # Inductor compiles forward and backward twice: 224 s cold on this CPU
@pytest.mark.parametrize("amp", ["fp32", "bf16"])
def test_the_compiled_step_of_a_cold_model_matches_the_eager_step(amp):
    torch._dynamo.reset()
    precision = Precision("cpu", torch.bfloat16 if amp == "bf16" else None)
    loss_fn = SegmentationLoss(lambda_dice=1.0, num_classes=CLASSES, check_labels=False)
    compiled_model, eager_model = cold_model(), None
    eager_model = copy.deepcopy(compiled_model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (compiled_model, eager_model)]
    step = CompiledStep(iteration(compiled_model, precision, loss_fn), "default", CPU)
    eager_objective = iteration(eager_model, precision, loss_fn)
    loss_tol, grad_tol, least_cosine = TOLERANCES[amp]
    for clips, masks in batches(2):
        (compiled_loss,) = step.step((clips, masks), optimizers[0], None, [])
        eager_loss = eager_objective(clips, masks)
        optimizer_step(eager_loss, optimizers[1], None, [])
        assert torch.isclose(compiled_loss, eager_loss.detach(), rtol=loss_tol, atol=0.0), (
            f"{amp}: loss {compiled_loss.item()} compiled against {eager_loss.item()} eager"
        )
        for name, (error, cosine) in gradient_errors(compiled_model, eager_model).items():
            assert error <= grad_tol and cosine >= least_cosine, (
                f"{amp}: gradient of {name}: relative error {error:.2e}, cosine {cosine:.6f}"
            )
    assert step.mode == "default" and step.fallback_reason is None


def test_the_step_reads_its_inputs_through_static_buffers_of_its_own():
    step = CompiledStep(lambda x, flag: x.sum() if flag else x, "default", CPU)
    first, second = torch.ones(2, 3), torch.full((2, 3), 2.0)
    held = step.static_inputs((first, True))
    again = step.static_inputs((second, True))
    assert held[0] is again[0] and held[0] is not second and held[1] is True
    assert torch.equal(again[0], second)  # the second batch's values, in the same buffer
    resized = step.static_inputs((torch.zeros(4, 3), True))[0]
    assert resized is not held[0] and resized.shape == (4, 3)
    eager = CompiledStep(lambda x: x, "none", CPU)
    assert eager.static_inputs((first,))[0] is first  # eager: no buffer, no copy


def test_a_failing_cuda_graph_mode_falls_back_to_default_once_and_logs_why(monkeypatch, caplog):
    modes: list[str] = []

    def fake_compile(objective, mode):
        modes.append(mode)
        if mode == "reduce-overhead":
            return lambda *args: (_ for _ in ()).throw(RuntimeError("capture failed: op X"))
        return objective

    monkeypatch.setattr("fedst.accel.compiled.maybe_compile", fake_compile)
    weight = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    step = CompiledStep(lambda x: (weight * x).sum(), "reduce-overhead", torch.device("cuda"))
    monkeypatch.setattr("fedst.accel.compiled.begin_step", lambda cuda_graphs: None)
    with caplog.at_level("WARNING", logger="fedst.accel"):
        (loss,) = step.step((torch.ones(3),), optimizer, None, [weight])
    assert modes == ["reduce-overhead", "default"] and step.mode == "default"
    assert "capture failed: op X" in step.fallback_reason and "capture failed" in caplog.text
    assert float(loss) == 3.0 and torch.allclose(weight.detach(), torch.full((3,), 0.9))


def test_a_failure_in_default_mode_is_raised():
    step = CompiledStep(lambda x: x.missing(), "default", CPU)
    with pytest.raises(Exception, match="missing"):
        step.step(
            (torch.ones(3),), torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), None, []
        )


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


def test_a_site_prepares_the_temporal_layout_before_it_builds_its_compiled_step(
    tiny_root, tmp_path, monkeypatch
):
    calls: list[str] = []
    prepare = FedSTNet.prepare_temporal

    def recorded_prepare(self, image_size):
        calls.append(f"prepare {tuple(image_size)}")
        return prepare(self, image_size)

    def recorded_step(objective, mode, device):
        calls.append(f"compile {mode}")
        return CompiledStep(objective, "none", device)  # the order is the point, not Inductor

    monkeypatch.setattr(FedSTNet, "prepare_temporal", recorded_prepare)
    monkeypatch.setattr(site_module, "CompiledStep", recorded_step)
    cfg = experiment(tiny_root, "train.num_workers=0", "train.compile=reduce-overhead")
    site = Site(cfg.data.federation[0], cfg, tmp_path / "site", CPU)
    assert calls == [f"prepare {tuple(cfg.clip.image_size)}", "compile reduce-overhead"]
    site.train_phase(LocalPhase(1), server_round=1)  # the step runs through CompiledStep.step

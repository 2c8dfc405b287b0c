"""Specification: a steady training iteration makes the host wait for the device nowhere (issue 60,
item 5). A dispatch-mode counter records every aten op that reads a device value on the host
(``_local_scalar_dense``: ``.item()``, ``bool(t)``, ``if t.any()``; ``nonzero`` and the other
ops whose output shape depends on values) and every copy between devices, over the forward pass,
loss, backward pass and optimizer step of a site's iteration and of a SERQ batch (EQ and SC).

What the CPU can show: the ops themselves are dispatched alike on the CPU and on CUDA, so an op
that would sync on CUDA is counted here. The optimizers are built as on CUDA
(``fused_optimizer_options`` of a CUDA device: fused Adam/AdamW, which keeps its step counter as
a tensor; the CPU's default single-tensor Adam reads it with ``.item()``, harmless on the CPU and
not what a GPU runs). Copies between devices cannot occur on a CPU-only machine: that count is 0
here by construction; on CUDA the GPU check runs the same counter. A steady iteration is the
difference between a phase of 3 iterations and one of 1, so what a phase does once (its one read
of the losses) is not counted."""

from __future__ import annotations

import collections
import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fedst.cli import compose_experiment
from fedst.data.clips import BatchStream
from fedst.data.generic import GenericLayoutSource
from fedst.data.procedural import generate
from fedst.federation import site as site_module
from fedst.federation.site import Site
from fedst.methods import LocalPhase, method_of
from fedst.methods import serq as serq_module
from fedst.methods.serq import Serq
from tests.conftest import write_generic_site
from tests.test_federation import experiment
from tests.test_gpu_feeding import datasets

pytestmark = pytest.mark.usefixtures("single_torch_thread")

CPU = torch.device("cpu")

HOST_READS = (
    "_local_scalar_dense",
    "item",
    "is_nonzero",
    "equal",
    "nonzero",
    "masked_select",
    "_unique2",
    "unique_consecutive",
)
"""aten ops that make the host wait for a device value (a scalar read, or an output whose shape
depends on the values)."""


class HostSyncCounter(TorchDispatchMode):
    """Counts :data:`HOST_READS` ops and copies whose source and destination devices differ."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        out = func(*args, **kwargs)
        if name in HOST_READS:
            self.counts[name] += 1
        elif name in ("_to_copy", "copy_"):
            source = args[1] if name == "copy_" else args[0]
            target = args[0] if name == "copy_" else out
            if source.device != target.device:
                self.counts[f"{name} {source.device}->{target.device}"] += 1
        return out


def as_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Build the optimizers of sites and SERQ as on a CUDA device (fused Adam / AdamW)."""
    for module in (site_module, serq_module):
        monkeypatch.setattr(module, "fused_optimizer_options", lambda device: {"fused": True})


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


def phase_syncs(site: Site, iterations: int) -> collections.Counter[str]:
    with HostSyncCounter() as counter:
        site.train_phase(LocalPhase(iterations), server_round=1)
    return counter.counts


@pytest.mark.parametrize("clip_frame_loss_weight", [0.0, 0.5])  # 0.5: every clip frame's loss too
def test_a_steady_site_iteration_reads_nothing_from_the_device(
    tiny_root, tmp_path, monkeypatch, clip_frame_loss_weight
):
    as_on_cuda(monkeypatch)
    cfg = experiment(
        tiny_root,
        "train.num_workers=0",
        "pretraining.iters=0",
        f"train.clip_frame_loss_weight={clip_frame_loss_weight}",
    )
    site = Site(cfg.data.federation[0], cfg, tmp_path / "site", CPU)
    assert site.optimizer.defaults["fused"] is True
    batch = site.stream.next_batch()  # the loader's own work is not the step's (test_clips.py)
    monkeypatch.setattr(site.stream, "next_batch", lambda: batch)
    phase_syncs(site, 1)  # warm-up: lazy optimizer state, first-call paths
    one, three = phase_syncs(site, 1), phase_syncs(site, 3)
    assert three - one == collections.Counter()  # 2 steady iterations: no host read, no copy


@pytest.fixture
def serq(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Serq:
    as_on_cuda(monkeypatch)
    write_generic_site(tmp_path, "synthetic", videos={"v0": 5, "v1": 4}, size=(32, 40))
    augmented, reference = datasets(GenericLayoutSource(tmp_path, "synthetic"))
    cfg, _ = compose_experiment(["experiment=tiny"])
    method = method_of(cfg)
    return Serq(
        dataclasses.replace(cfg.serq, batches_per_round=3, batch_size=2),
        synthetic_model=method.build_model(),
        stream=BatchStream(augmented, batch_size=2, seed=0, num_classes=4),
        reference=reference,
        indicator=method.indicators().get("synthetic"),
        loss_fn=method.segmentation_loss(),
        device=CPU,
        feature_stage=1,
    )


def test_a_steady_serq_batch_reads_nothing_from_the_device(serq):
    global_model = copy.deepcopy(serq.synthetic_model)
    serq.step(global_model)  # round 1: the optimizers' state, every drawn sample in the bank
    plan = serq._draw_plan()
    canonical = list(serq.canonical_batches(plan))  # on the device, as the passes read them
    augmented = list(serq.augmented_batches(plan))

    def syncs(batches: int) -> collections.Counter[str]:
        with HostSyncCounter() as counter:
            serq.explicit_quantification(global_model, canonical[:batches])
            serq.synchronize_convergence(global_model, augmented[:batches])
        return counter.counts

    assert serq.global_optimizer.defaults["fused"] is True
    assert serq.pre_optimizer.defaults["fused"] is True
    one, three = syncs(1), syncs(3)
    assert three - one == collections.Counter()  # 2 steady batches of EQ and SC

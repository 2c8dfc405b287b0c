"""Specification of SERQ's feature bank: the EQ target of a sample is the bank entry of the very view
EQ compares it with, even when the sample is drawn again under another augmentation."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch

from fedst.cli import compose_experiment
from fedst.data.clips import AugmentConfig, BatchStream, ClipDataset
from fedst.data.generic import GenericLayoutSource
from fedst.methods import method_of
from fedst.methods.serq import Serq
from tests.conftest import write_generic_site


def test_the_eq_target_of_a_sample_drawn_twice_under_two_augmentations_is_its_view(
    tmp_path: Path,
):
    cfg, _ = compose_experiment(["experiment=tiny"])
    write_generic_site(tmp_path, "synthetic", videos={"only": 1}, size=(64, 80))
    source = GenericLayoutSource(tmp_path, "synthetic")
    clip = cfg.clip_config()
    strong = AugmentConfig(rotate_limit_deg=45, scale_limit=0.3)
    stream = BatchStream(ClipDataset(source, "train", clip, strong), batch_size=1, seed=0)
    global_model = method_of(cfg).build_model()
    serq = Serq(
        dataclasses.replace(cfg.serq, batches_per_round=2, batch_size=1, ema_mu=0.5),
        synthetic_model=copy.deepcopy(global_model),
        stream=stream,
        reference=ClipDataset(source, "train", clip, None),
        indicator=method_of(cfg).indicators().get("synthetic"),
        loss_fn=method_of(cfg).segmentation_loss(),
        device=torch.device("cpu"),
        feature_stage=1,
    )
    seen: dict[str, list] = {"eq": [], "sc": []}
    eq, sc = serq.explicit_quantification, serq.synchronize_convergence
    serq.explicit_quantification = lambda g, b: (seen["eq"].append(list(b)), eq(g, b))[1]
    serq.synchronize_convergence = lambda g, b: (seen["sc"].append(list(b)), sc(g, b))[1]
    global_before = copy.deepcopy(global_model).eval()  # EQ keeps the global model fixed

    serq.step(global_model)

    (sc_batches,) = seen["sc"]
    assert [ids for _, _, ids in sc_batches] == [["synthetic/only/0"]] * 2  # drawn twice ...
    assert not torch.equal(sc_batches[0][0], sc_batches[1][0])  # ... under two augmentations
    (eq_batches,) = seen["eq"]
    with torch.no_grad():
        for images, _, ids in eq_batches:
            # F_g of exactly the pixels EQ compared F_sy with (Eq. 10 fed only this view, twice)
            _, target = serq._forward(global_before, images)
            assert torch.equal(serq.feature_bank[ids[0]], target[0].to(torch.float16))

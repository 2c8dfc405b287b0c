"""Specification of SERQ's data path: a round is planned, then streamed batch by batch, with the
very samples, augmentations, statistics and models of the round that materialised all its
batches up front; the server's synthetic images are read once (1-frame clips), as the network
without its temporal module reads only a clip's current frame. Device: the CPU (the servers
are built on torch.device("cpu")), where the bit-for-bit comparisons hold without
deterministic switches."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from fedst.data.clips import BatchStream, ClipDataset
from fedst.data.procedural import generate
from fedst.federation.server import FederationServer
from fedst.methods import method_of
from fedst.methods.serq import Serq
from fedst.seeding import seed_everything
from tests.test_federation import experiment

ROUNDS = 2
BATCHES = 3


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


def serq_config(tiny_root: Path):
    return experiment(
        tiny_root, f"serq.batches_per_round={BATCHES}", "serq.batch_size=2", "train.num_workers=0"
    )


def four_frame_sets(server: FederationServer) -> tuple[BatchStream, ClipDataset]:
    """The server's synthetic stream and reference as they were before: clips of clip.num_frames
    (4) frames, every frame the same image."""
    cfg = server.cfg
    source = cfg.data.open(cfg.data.server)
    clip = cfg.clip_config()
    assert clip.num_frames == 4
    stream = server.step.serq.stream
    dataset = ClipDataset(source, "train", clip, cfg.augment, validate=False)
    four = BatchStream(
        dataset, stream.batch_size, stream.seed, 0, stream.device, stream.num_classes
    )
    return four, ClipDataset(source, "train", clip, None, validate=False)


def materialised_step(serq: Serq, global_model) -> tuple:
    """SERQ's round as it was: every augmented batch drawn with next_batch and every canonical
    view read with ClipDataset.__getitem__, all held in memory, then EQ and SC."""
    batches = [serq.stream.next_batch() for _ in range(serq.cfg.batches_per_round)]
    canonical = []
    for _, _, ids in batches:
        samples = [serq.reference[serq.reference.index_of(i)] for i in ids]
        canonical.append(
            (torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples]), ids)
        )
    eq = serq.explicit_quantification(global_model, canonical)
    sc = serq.synchronize_convergence(global_model, batches)
    return (*eq, *sc)


def test_a_streamed_round_equals_the_materialised_round_of_4_frame_clips(tiny_root, tmp_path):
    cfg = serq_config(tiny_root)
    servers = []
    for name in ("streamed", "materialised"):
        torch.manual_seed(0)  # the same models and D_sy
        servers.append(FederationServer(cfg, tmp_path / name, torch.device("cpu")))
    streamed, materialised = servers
    materialised.step.serq.stream, materialised.step.serq.reference = four_frame_sets(materialised)
    assert streamed.step.serq.stream.dataset.clip_length == 1  # the server reads 1-frame clips

    for server_round in range(1, ROUNDS + 1):
        seed_everything(cfg.seed, 0x5E12, server_round)
        stats = streamed.step.serq.step(streamed.global_model)
        seed_everything(cfg.seed, 0x5E12, server_round)
        expected = materialised_step(materialised.step.serq, materialised.global_model)
        got = (
            stats.eq_loss,
            stats.eq_feature_gap,
            stats.synthetic_feature_rms,
            stats.bank_feature_rms,
            stats.sc_loss,
            stats.sc_feature_gap,
            stats.global_feature_rms,
        )
        assert got == expected  # bit-identical on the CPU
    a, b = streamed.step.serq, materialised.step.serq
    for model_a, model_b in (
        (streamed.global_model, materialised.global_model),
        (a.synthetic_model, b.synthetic_model),
    ):
        for (key, value), other in zip(
            model_a.state_dict().items(), model_b.state_dict().values(), strict=True
        ):
            assert torch.equal(value, other), key
    assert torch.equal(a.domain_descriptor, b.domain_descriptor)
    assert a.feature_bank.keys() == b.feature_bank.keys()
    assert all(torch.equal(a.feature_bank[k], b.feature_bank[k]) for k in a.feature_bank)
    assert a.stream.state_dict() == b.stream.state_dict()


def test_a_plan_streams_the_batches_next_batch_would_return_and_advances_alike(tiny_root):
    cfg = serq_config(tiny_root)
    source = cfg.data.open(cfg.data.server)
    clip = dataclasses.replace(cfg.clip_config(), num_frames=1)
    dataset = ClipDataset(source, "train", clip, cfg.augment, validate=False)
    num_batches = len(dataset) // 2 + 2  # crosses an epoch boundary
    drawn = BatchStream(dataset, batch_size=2, seed=5)
    planned = BatchStream(dataset, batch_size=2, seed=5, num_workers=1)
    expected = [drawn.next_batch() for _ in range(num_batches + 1)]
    planned.next_batch()  # a live loader, which the plan must not leave behind

    plan = planned.next_plan(num_batches)
    got = list(planned.load_plan(plan))

    assert len(got) == len(plan) == num_batches
    for (images, masks, ids), (want_images, want_masks, want_ids) in zip(
        got, expected[1:], strict=True
    ):
        assert ids == want_ids
        assert torch.equal(images, want_images) and torch.equal(masks, want_masks)
    assert planned.state_dict() == drawn.state_dict()
    after = planned.next_batch()  # continues where next_batch x N would have
    want = drawn.next_batch()
    assert after[2] == want[2] and torch.equal(after[0], want[0])


def test_without_the_temporal_module_a_clip_of_4_identical_frames_is_its_1_frame_clip(tiny_root):
    cfg = serq_config(tiny_root)
    torch.manual_seed(0)
    model = method_of(cfg).build_model().eval()
    indicator = method_of(cfg).indicators().get(cfg.data.server)
    frame = torch.randn(2, 1, 3, *cfg.clip_config().image_size)
    with torch.no_grad():
        logits_1, feats_1 = model(frame, indicator, use_temporal=False, return_features=True)
        logits_4, feats_4 = model(
            frame.repeat(1, 4, 1, 1, 1), indicator, use_temporal=False, return_features=True
        )
    torch.testing.assert_close(logits_4, logits_1, rtol=0, atol=1e-6)
    for four, one in zip(feats_4, feats_1, strict=True):
        torch.testing.assert_close(four, one, rtol=0, atol=1e-6)

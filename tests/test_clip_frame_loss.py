"""Specification of CFFM's supervision of every clip frame (``train.clip_frame_loss_weight``;
docs/design-notes.md, "The temporal module against CFFM", row 11).

* a training clip carries every clip frame's label, [T, H, W] oldest first, through the clip's
  one augmentation (each frame stays aligned with its own mask); a clip frame without a label is
  255 (ignore) everywhere, and adds nothing to the loss;
* every clip frame's own prediction is the single-frame network's on that frame, from the clip's
  one encoder pass;
* the local objective is CFFM's ``0.5 CE(every frame's own prediction) + CE(temporal
  prediction)``, written out here (with ``train.lambda_dice=0`` our L_seg is CE);
* at weight 0 no earlier frame's label is read, and a site's losses are those of the loop
  before the option, bit for bit;
* the positive control's own loop (studies/temporal_control) adds the term under the override.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import PART_COLOURS, draw_frame, record_reads
from test_clips import to_rgb255

from fedst.accel import optimizer_step
from fedst.cli import compose_experiment
from fedst.config import ConfigError
from fedst.data.clips import AugmentConfig, ClipConfig, ClipDataset
from fedst.data.generic import GenericLayoutSource
from fedst.data.procedural import generate
from fedst.experiment import experiment_from_json, site_view
from fedst.experiment.sections import TrainConfig
from fedst.federation.site import Site, StateMismatchError, claim_state_dir
from fedst.methods import LocalPhase
from fedst.model.losses import SegmentationLoss, clip_frame_loss
from fedst.model.network import build_network
from fedst.runs.layout import STATE_FINGERPRINT
from fedst.scoring.site_data import PooledClips, open_site_data
from studies.temporal_control import temporal_control
from tests.test_federation import experiment
from tests.test_network import INDICATOR, TINY, clip_of
from tests.test_state_fingerprint import digest, values_before_roles

pytestmark = pytest.mark.usefixtures("single_torch_thread")

IGNORE = 255
CLIP = ClipConfig(num_frames=4, interval_s=0.2, image_size=(32, 40))
COLOURS = {0: None, **PART_COLOURS}


def frame_labelled_dataset(site, augment: AugmentConfig | None = None, **kwargs) -> ClipDataset:
    return ClipDataset(
        GenericLayoutSource(site.root, site.name),
        "train",
        CLIP,
        augment,
        clip_frame_labels=True,
        **kwargs,
    )


def resized_label(index: int, size: tuple[int, int] = (32, 40)) -> np.ndarray:
    label = draw_frame(index, size)[1]
    return cv2.resize(label, (CLIP.image_size[1], CLIP.image_size[0]), cv2.INTER_NEAREST)


# -- the clip frames' labels in the data path ---------------------------------------------------


def test_a_training_clip_carries_every_clip_frames_label_oldest_first(write_site):
    site = write_site("D", videos={"v1": 6})
    dataset = frame_labelled_dataset(site)
    clip, masks, sample_id = dataset[5]
    assert sample_id == "D/v1/5" and clip.shape == (4, 3, 32, 40)
    assert masks.shape == (4, 32, 40) and masks.dtype == torch.int64
    for t, position in enumerate([2, 3, 4, 5]):  # clip_frame_positions at 5 fps, 0.2 s
        np.testing.assert_array_equal(masks[t].numpy(), resized_label(position))
    # the instrument moves from frame to frame, so the four labels differ
    assert len({masks[t].numpy().tobytes() for t in range(4)}) == 4


def test_an_unlabelled_clip_frame_is_ignore_everywhere(write_site):
    site = write_site("D", videos={"v1": 8}, label_every=2)  # frames 0, 2, 4, 6 labelled
    dataset = frame_labelled_dataset(site)
    _, masks, _ = dataset[dataset.index_of("D/v1/6")]  # clip frames 3, 4, 5, 6
    assert (masks[0] == IGNORE).all() and (masks[2] == IGNORE).all()
    np.testing.assert_array_equal(masks[1].numpy(), resized_label(4))
    np.testing.assert_array_equal(masks[3].numpy(), resized_label(6))


def colour_classes(rgb: np.ndarray) -> np.ndarray:
    """[H, W, 3] RGB 0..255 -> the class whose colour a pixel is within 30 of (0: none of
    the part colours), as :func:`conftest.draw_frame` paints them."""
    classes = np.zeros(rgb.shape[:2], dtype=np.int64)
    for part, colour in PART_COLOURS.items():
        classes[np.abs(rgb - np.array(colour)).max(axis=-1) < 30] = part
    return classes


def test_augmentation_keeps_every_clip_frame_aligned_with_its_own_mask(write_site):
    """Each clip frame's mask is its frame's colours, after rotation, scale and flips (the masks
    take the frames' one transform); against another frame's mask the agreement drops."""
    site = write_site("D", videos={"v1": 6}, size=(64, 80))
    augment = AugmentConfig(rotate_limit_deg=40, scale_limit=0.2, hflip=True, vflip=True)
    dataset = ClipDataset(
        GenericLayoutSource(site.root, "D"),
        "train",
        dataclasses.replace(CLIP, image_size=(64, 80)),
        augment,
        clip_frame_labels=True,
    )
    for aug_seed in range(6):
        clip, masks, _ = dataset[(5, aug_seed)]  # clip frames 2, 3, 4, 5: four instrument tips
        rgb = to_rgb255(clip)  # [T, H, W, 3]
        rotated_in = masks[-1].numpy() == IGNORE  # the current label's (the mask target's) fill
        assert rotated_in.any() or aug_seed > 0
        for t in range(4):
            labelled = masks[t].numpy() != IGNORE
            np.testing.assert_array_equal(~labelled, rotated_in)  # one geometry for every mask
            own = (colour_classes(rgb[t]) == masks[t].numpy())[labelled].mean()
            assert own > 0.97, (aug_seed, t, own)
            other = (colour_classes(rgb[t]) == masks[(t + 2) % 4].numpy())[labelled].mean()
            assert other < own - 0.02, (aug_seed, t, own, other)


def test_the_clip_and_the_current_label_are_those_of_a_clip_without_frame_labels(write_site):
    site = write_site("D", videos={"v1": 6})
    augment = AugmentConfig(rotate_limit_deg=40, scale_limit=0.2, hflip=True)
    source = GenericLayoutSource(site.root, "D")
    with_labels = ClipDataset(source, "train", CLIP, augment, clip_frame_labels=True)
    without = ClipDataset(source, "train", CLIP, augment)
    for aug_seed in range(3):
        clip, masks, _ = with_labels[(4, aug_seed)]
        clip_0, mask_0, _ = without[(4, aug_seed)]
        assert torch.equal(clip, clip_0) and mask_0.shape == (32, 40)
        assert torch.equal(masks[-1], mask_0)


def test_without_frame_labels_no_earlier_label_is_read(write_site, monkeypatch):
    site = write_site("D", videos={"v1": 6})
    source = GenericLayoutSource(site.root, "D")
    reads = record_reads(monkeypatch)
    ClipDataset(source, "train", CLIP, validate=False).load_raw(5)
    assert [p for p in reads if p.parent.name == "masks"] == [site.masks["v1"][5]]
    reads.clear()
    ClipDataset(source, "train", CLIP, validate=False, clip_frame_labels=True).load_raw(5)
    assert sorted(p for p in reads if p.parent.name == "masks") == [
        site.masks["v1"][i] for i in (2, 3, 4, 5)
    ]


def test_the_config_asks_for_frame_labels_only_with_a_weight_and_a_temporal_network(tmp_path):
    cfg = experiment(tmp_path)
    assert cfg.train.clip_frame_loss_weight == 0.5 and cfg.uses_clip_frame_labels()  # CFFM's
    assert not experiment(tmp_path, "train.clip_frame_loss_weight=0").uses_clip_frame_labels()
    single = experiment(tmp_path, "train.clip_frame_loss_weight=0.5", "method.temporal=false")
    assert not single.uses_clip_frame_labels()
    paper = experiment(tmp_path, "experiment=paper", "train.device=cpu")
    assert paper.train.clip_frame_loss_weight == 0.5  # CFFM's


@pytest.mark.parametrize("weight", [-0.5, float("nan"), float("inf"), True, "half"])
def test_a_bad_weight_is_a_config_error_naming_the_field(weight):
    with pytest.raises(ConfigError, match=r"train\.clip_frame_loss_weight"):
        TrainConfig(clip_frame_loss_weight=weight)


def test_a_state_folder_from_before_the_option_is_claimed_at_weight_zero_only(tmp_path):
    """A run written before ``train.clip_frame_loss_weight`` trained the current frame only:
    resumed at weight 0 its site states are its own; at 0.5 they are another run's."""
    cfg = experiment(tmp_path, "train.clip_frame_loss_weight=0")
    values = values_before_roles(cfg)  # the fingerprint's rule (tests/test_state_fingerprint.py)
    values["train"].pop("clip_frame_loss_weight")  # the config as that code wrote it
    before = digest(values)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    written = json.loads(site_view(cfg).to_json())
    written["train"].pop("clip_frame_loss_weight")
    record = {"fingerprint": before, "site": "A", "config": written}
    (state_dir / STATE_FINGERPRINT).write_text(json.dumps(record))
    claim_state_dir(state_dir, "A", cfg)  # no StateMismatchError
    weighted = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, clip_frame_loss_weight=0.5)
    )
    with pytest.raises(StateMismatchError, match=r"train\.clip_frame_loss_weight=None->0\.5"):
        claim_state_dir(state_dir, "A", weighted)


# -- every clip frame's own prediction ------------------------------------------------------------


@pytest.mark.parametrize("placement", ["decode_head", "encoder"])
def test_every_clip_frames_logits_are_the_single_frame_networks_on_that_frame_from_one_pass(
    placement,
):
    torch.manual_seed(0)
    config = dataclasses.replace(
        TINY, prompt=True, channel_selection=True, temporal_placement=placement
    )
    net = build_network(config).eval()
    clip = clip_of(batch=2)
    indicator = torch.stack([INDICATOR, INDICATOR.flip(0)])  # [B, D]: one per clip
    encoder_calls = []
    net.encoder.register_forward_hook(lambda *args: encoder_calls.append(1))
    with torch.no_grad():
        logits, frame_logits = net(clip, indicator, return_frame_logits=True)
        assert len(encoder_calls) == 1  # the clip's one batched pass
        torch.testing.assert_close(logits, net(clip, indicator))
        assert frame_logits.shape == (2, 4, TINY.num_classes, *clip.shape[-2:])
        for t in range(4):
            alone = net(clip[:, [t]], indicator, use_temporal=False)  # frame t, no history
            torch.testing.assert_close(frame_logits[:, t], alone, rtol=1e-4, atol=1e-5)
    if placement == "encoder":  # its frame logits come from the temporal module's clip pass
        with pytest.raises(ValueError, match="return_frame_logits needs the temporal module"):
            net(clip, indicator, use_temporal=False, return_frame_logits=True)


# -- the local objective ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


def test_the_local_objective_is_cffms_formula_written_out(tiny_root, tmp_path):
    """0.5 x CE over every clip frame's own prediction (each the single-frame network on that
    frame), mean over batch x frames x labelled pixels, + CE of the temporal prediction against
    the current frame's label; L_seg is CE alone at lambda_dice = 0 (CFFM's loss)."""
    cfg = experiment(tiny_root, "train.clip_frame_loss_weight=0.5", "train.lambda_dice=0")
    site = Site("A", cfg, tmp_path / "A", torch.device("cpu"))
    site.model.eval()  # no drop path: the two computations see one network
    clips, frame_masks, _ = site.stream.next_batch()
    frame_masks = frame_masks.clone()
    frame_masks[0, 1, :10] = IGNORE  # some ignored pixels in one earlier frame
    frame_masks[1, 0] = IGNORE  # an unlabelled clip frame
    indicator = site.indicator
    with torch.no_grad():
        objective = site._forward_loss(clips, indicator, frame_masks[:, -1], frame_masks)
        temporal = site.model(clips, indicator)  # [B, K, H, W]
        own = torch.stack(
            [site.model(clips[:, [t]], indicator, use_temporal=False) for t in range(4)], dim=1
        )  # [B, T, K, H, W]
    per_pixel = F.cross_entropy(
        own.movedim(2, -1).reshape(-1, own.shape[2]),
        frame_masks.reshape(-1),
        ignore_index=IGNORE,
        reduction="none",
    )
    labelled = frame_masks.reshape(-1) != IGNORE
    frames_ce = per_pixel[labelled].mean()
    temporal_ce = F.cross_entropy(temporal, frame_masks[:, -1], ignore_index=IGNORE)
    expected = 0.5 * frames_ce + temporal_ce
    torch.testing.assert_close(objective, expected, rtol=1e-5, atol=1e-6)
    assert frames_ce > 0.1 and temporal_ce > 0.1  # both terms count


def test_an_unlabelled_clip_frame_adds_nothing_to_the_loss_nor_to_the_gradient():
    torch.manual_seed(0)
    frame_logits = torch.randn(2, 4, 4, 8, 10, requires_grad=True)
    labels = torch.randint(0, 4, (2, 4, 8, 10))
    labels[:, 0] = IGNORE  # the oldest clip frame of each clip has no label
    loss_fn = SegmentationLoss(lambda_dice=0.3, num_classes=4)
    loss = clip_frame_loss(loss_fn, frame_logits, labels)
    labelled_only = loss_fn(frame_logits[:, 1:].flatten(0, 1), labels[:, 1:].flatten(0, 1))
    torch.testing.assert_close(loss, labelled_only)
    loss.backward()
    assert frame_logits.grad[:, 0].abs().max() == 0
    assert frame_logits.grad[:, 1:].abs().max() > 0


def todays_losses(site: Site, steps: int) -> list[float]:
    """A site's local loop as it was before ``train.clip_frame_loss_weight`` (ad3d339's
    Site.train_phase, eager): the current frame's label, the method's local loss, AdamW."""
    site.model.train()
    losses = []
    for _ in range(steps):
        clips, masks, _ = site.stream.next_batch()
        assert masks.dim() == 3  # [B, H, W]: no earlier frame's label
        logits = site.model(clips, site.indicator)
        loss = site.method.local_loss(site, logits.float(), masks)
        optimizer_step(loss, site.optimizer, None, site.model.parameters(), None)
        losses.append(loss.item())
    return losses


def test_weight_zero_gives_the_losses_of_the_loop_before_the_option_bit_for_bit(
    tiny_root, tmp_path
):
    cfg = experiment(tiny_root, "train.clip_frame_loss_weight=0")
    torch.manual_seed(1)
    ours = Site("A", cfg, tmp_path / "ours", torch.device("cpu")).train_phase(LocalPhase(3), 1)
    torch.manual_seed(1)
    before = todays_losses(Site("A", cfg, tmp_path / "before", torch.device("cpu")), 3)
    assert ours == before


# -- the positive control's own loop ---------------------------------------------------------------


def test_the_positive_controls_training_adds_the_clip_frame_term_under_the_override(
    tiny_root, monkeypatch
):
    calls = []

    def counted(loss_fn, frame_logits, frame_labels):
        calls.append(tuple(frame_labels.shape))
        return clip_frame_loss(loss_fn, frame_logits, frame_labels)

    monkeypatch.setattr(temporal_control, "clip_frame_loss", counted)
    overrides = ("method=upperbound", "train.clip_frame_loss_weight=0.5")
    temporal_cfg = experiment(tiny_root, *overrides, "method.temporal=true")  # as the control's
    train = PooledClips([open_site_data(temporal_cfg, s, ("train",)).train for s in "AB"])
    temporal_control.train_network(temporal_cfg, train, steps=2)
    assert calls == [(2, 4, 64, 80)] * 2  # every step, every clip frame's label
    single_cfg = experiment(tiny_root, *overrides, "method.temporal=false")
    temporal_control.train_network(single_cfg, train, steps=1)  # [B, T, H, W] masks, one frame
    assert len(calls) == 2  # the single-frame network predicts the current frame only


# -- runs saved before CFFM's design became the default ----------------------------------------------


def test_a_run_saved_before_the_cffm_defaults_reads_as_encoder_placed_and_current_frame_only():
    """config.json files written before ``network.temporal_placement`` and
    ``train.clip_frame_loss_weight`` existed trained the temporal module at encoder stage 1 on the
    current frame's label only; today's defaults are CFFM's (decode head, every frame at 0.5)."""
    cfg, _ = compose_experiment(["experiment=demo"])
    assert (cfg.network.temporal_placement, cfg.train.clip_frame_loss_weight) == (
        "decode_head",
        0.5,
    )
    saved = json.loads(cfg.to_json())
    del saved["network"]["temporal_placement"], saved["train"]["clip_frame_loss_weight"]
    old = experiment_from_json(json.dumps(saved))
    assert (old.network.temporal_placement, old.train.clip_frame_loss_weight) == ("encoder", 0.0)
    assert experiment_from_json(cfg.to_json()) == cfg  # a config saved today reads as written

"""Specification of the photometric augmentation (hue shift, Gaussian blur; issue 15): off by
default, and one draw per clip, so the 4 frames of a clip get the same photometric transform."""

from __future__ import annotations

import albumentations as A
import cv2
import numpy as np
import pytest
import torch

from fedst.data.clips import AugmentConfig, ClipConfig, ClipDataset, build_augmentation
from fedst.data.generic import GenericLayoutSource
from tests.test_clips import to_rgb255

NO_GEOMETRY = {"rotate_limit_deg": 0, "scale_limit": 0}


def test_the_defaults_add_no_photometric_transform():
    assert (AugmentConfig().hue, AugmentConfig().blur_sigma, AugmentConfig().color_jitter) == (
        0,
        0,
        0,
    )
    assert [type(t) for t in build_augmentation(AugmentConfig(), 4).transforms] == [A.Affine]


@pytest.mark.parametrize(
    "photometric",
    [{"hue": 0.2}, {"blur_sigma": 2.0}, {"hue": 0.2, "blur_sigma": 2.0, "color_jitter": 0.4}],
)
def test_a_clips_four_frames_get_the_same_photometric_transform(write_site, photometric):
    site = write_site("S", videos={"img1": 1}, size=(48, 64))  # one image: 4 identical frames
    augment = AugmentConfig(**NO_GEOMETRY, **photometric)
    dataset = ClipDataset(GenericLayoutSource(site.root, "S"), "train", ClipConfig(), augment)
    plain = ClipDataset(GenericLayoutSource(site.root, "S"), "train", ClipConfig())[0][0]
    changed = 0
    for aug_seed in range(6):
        frames, _, _ = dataset[(0, aug_seed)]
        assert frames.shape[0] == 4
        for t in range(1, 4):
            assert torch.equal(frames[t], frames[0]), (aug_seed, t)
        changed += not torch.equal(frames, plain)
    assert changed >= 4  # the transform does act


def test_a_hue_shift_turns_colours_and_leaves_greys(write_site):
    site = write_site("S", videos={"img1": 1}, size=(48, 64))
    augment = AugmentConfig(**NO_GEOMETRY, hue=0.3)
    dataset = ClipDataset(GenericLayoutSource(site.root, "S"), "train", ClipConfig(), augment)
    frames, mask, _ = dataset[(0, 3)]
    rgb = np.clip(np.round(to_rgb255(frames[-1])), 0, 255).astype(np.uint8)
    hsv = cv2.cvtColor(rgb, cv2.COLOR_RGB2HSV_FULL).astype(int)
    background = mask.numpy() == 0
    original_hue = cv2.cvtColor(np.uint8([[[20, 90, 50]]]), cv2.COLOR_RGB2HSV_FULL)[0, 0, 0]
    hue_change = np.abs(hsv[background][:, 0] - int(original_hue))
    assert np.median(np.minimum(hue_change, 256 - hue_change)) > 5  # of 256 steps
    shaft = cv2.erode((mask.numpy() == 1).astype(np.uint8), np.ones((3, 3))) > 0
    grey = np.abs(rgb[shaft].astype(int) - 200).max(axis=1) <= 2  # (200, 200, 200) has no hue
    assert grey.mean() > 0.9  # all but pixels that the resize mixed with the wrist's blue


def test_a_blur_smooths_edges_and_keeps_the_mean_colour(write_site):
    site = write_site("S", videos={"img1": 1}, size=(48, 64))
    plain = ClipDataset(GenericLayoutSource(site.root, "S"), "train", ClipConfig())[0][0][-1]
    augment = AugmentConfig(**NO_GEOMETRY, blur_sigma=3.0)
    dataset = ClipDataset(GenericLayoutSource(site.root, "S"), "train", ClipConfig(), augment)
    sharpness = []
    for aug_seed in range(4):
        frame = dataset[(0, aug_seed)][0][-1]
        rgb, before = to_rgb255(frame), to_rgb255(plain)
        # gradient energy (a blur keeps a step's total variation but spreads and lowers it)
        sharpness.append(
            np.square(np.diff(rgb, axis=1)).sum() / np.square(np.diff(before, axis=1)).sum()
        )
        assert np.abs(rgb.mean((0, 1)) - before.mean((0, 1))).max() < 3
    assert min(sharpness) < 0.8

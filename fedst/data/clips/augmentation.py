"""The training augmentation: :class:`AugmentConfig` (rotation and scale as in the paper; flips,
colour jitter and blur optional) and :func:`build_augmentation`, one albumentations pipeline that
applies the same random transform to every frame of a clip and to its mask (areas rotated into
view: 0 in the images, 255 = ignore in the mask). One seed below :data:`AUG_SEED_HIGH` fixes a
sample's transform."""

from __future__ import annotations

import albumentations as A
import cv2

from fedst.data.base import (
    IGNORE_INDEX,
)
from fedst.schema.clips import AugmentConfig

AUG_SEED_HIGH = 2**31 - 1


def build_augmentation(augment: AugmentConfig, num_frames: int) -> A.Compose:
    """One albumentations pipeline for a T-frame clip: targets ``image`` (current frame) and
    ``frame_1`` .. ``frame_{T-1}``, all receiving the same random parameters as the ``mask``."""
    transforms: list[A.BasicTransform] = [
        A.Affine(
            rotate=(-augment.rotate_limit_deg, augment.rotate_limit_deg),
            scale=(1 - augment.scale_limit, 1 + augment.scale_limit),
            interpolation=cv2.INTER_LINEAR,
            mask_interpolation=cv2.INTER_NEAREST,
            border_mode=cv2.BORDER_CONSTANT,
            fill=0,
            fill_mask=IGNORE_INDEX,
            p=1.0,
        )
    ]
    if augment.hflip:
        transforms.append(A.HorizontalFlip(p=0.5))
    if augment.vflip:
        transforms.append(A.VerticalFlip(p=0.5))
    if augment.color_jitter > 0 or augment.hue > 0:
        strength = augment.color_jitter
        transforms.append(
            A.ColorJitter(
                brightness=strength, contrast=strength, saturation=strength, hue=augment.hue, p=1
            )
        )
    if augment.blur_sigma > 0:
        transforms.append(A.GaussianBlur(blur_limit=0, sigma_limit=(0.0, augment.blur_sigma), p=1))
    extra_frames = {f"frame_{i}": "image" for i in range(1, num_frames)}
    return A.Compose(transforms, additional_targets=extra_frames)

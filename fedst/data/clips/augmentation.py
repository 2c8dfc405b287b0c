"""The training augmentation: :class:`AugmentConfig` (rotation and scale as in the paper; flips,
colour jitter and blur optional) and :func:`build_augmentation`, one albumentations pipeline that
applies the same random transform to every frame of a clip and to its mask (areas rotated into
view: 0 in the images, 255 = ignore in the mask). One seed below :data:`AUG_SEED_HIGH` fixes a
sample's transform."""

from __future__ import annotations

from dataclasses import dataclass

import albumentations as A
import cv2

from fedst.data.base import (
    IGNORE_INDEX,
)

AUG_SEED_HIGH = 2**31 - 1


@dataclass(frozen=True)
class AugmentConfig:
    enabled: bool = True
    """Apply the augmentation at all (training sets only)."""
    rotate_limit_deg: float = 15
    """Rotation drawn uniformly from [-limit, limit] degrees (paper: rotation)."""
    scale_limit: float = 0.1
    """Zoom drawn uniformly from [1 - limit, 1 + limit] (paper: scale)."""
    hflip: bool = False
    """Horizontal flip with probability 0.5."""
    vflip: bool = False
    """Vertical flip with probability 0.5."""
    color_jitter: float = 0.0
    """Brightness, contrast and saturation jitter strength (0: off; hue: ``hue``)."""
    hue: float = 0.0
    """Hue shift of the colour jitter, drawn from [-hue, hue] of the hue circle (0: off; <= 0.5)."""
    blur_sigma: float = 0.0
    """Gaussian blur, sigma drawn uniformly from [0, blur_sigma] pixels at the network input
    (0: off)."""

    def __post_init__(self) -> None:
        for name in ("rotate_limit_deg", "scale_limit", "color_jitter", "hue", "blur_sigma"):
            if getattr(self, name) < 0:
                raise ValueError(f"augment.{name} must be >= 0, got {getattr(self, name)}")
        if self.scale_limit >= 1:
            raise ValueError(f"augment.scale_limit must be < 1, got {self.scale_limit}")
        if self.hue > 0.5:
            raise ValueError(f"augment.hue must be <= 0.5 (half the hue circle), got {self.hue}")


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

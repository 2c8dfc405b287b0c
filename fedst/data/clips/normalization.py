"""The network input: a frame resized to ``image_size`` (bilinear) and normalised with
:data:`IMAGENET_MEAN` / :data:`IMAGENET_STD`. :func:`normalize_clips` is the one implementation of
the normalisation, on any device (loader workers send uint8, the consumer normalises);
:func:`normalize_frames` applies it to frames in numpy's [T, H, W, 3] layout."""

from __future__ import annotations

import functools

import cv2
import numpy as np
import torch

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)

IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

_MEAN_255 = (np.array(IMAGENET_MEAN, dtype=np.float32) * 255).reshape(3, 1, 1)

_INV_STD_255 = (1 / (np.array(IMAGENET_STD, dtype=np.float32) * 255)).reshape(3, 1, 1)


def resize_frame(rgb: np.ndarray, image_size: tuple[int, int]) -> np.ndarray:
    """RGB uint8 [H0, W0, 3] -> [H, W, 3] at ``image_size`` = (H, W), bilinear (the network input)."""
    height, width = image_size
    return cv2.resize(rgb, (width, height), interpolation=cv2.INTER_LINEAR)


def normalize_frames(frames: np.ndarray) -> torch.Tensor:
    """uint8 [T, H, W, 3] -> float32 [T, 3, H, W]: scaled to [0, 1], minus :data:`IMAGENET_MEAN`,
    divided by :data:`IMAGENET_STD` (:func:`normalize_clips` after the channel transpose)."""
    return normalize_clips(torch.from_numpy(channels_first(frames)))


def channels_first(frames: np.ndarray) -> np.ndarray:
    """uint8 [T, H, W, 3] -> contiguous uint8 [T, 3, H, W]."""
    return np.ascontiguousarray(frames.transpose(0, 3, 1, 2))


def normalize_clips(frames: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 3, H, W] on any device -> float32 on that device: (x - 255 * mean) / (255 *
    std) with :data:`IMAGENET_MEAN` / :data:`IMAGENET_STD`, per channel."""
    if frames.dtype != torch.uint8 or frames.dim() < 3 or frames.shape[-3] != 3:
        raise ValueError(
            f"normalize_clips expects uint8 [..., 3, H, W] frames, got {frames.dtype} "
            f"{tuple(frames.shape)}"
        )
    mean, inv_std = _normalization_constants(frames.device)
    return (frames.float() - mean) * inv_std


@functools.cache
def _normalization_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(255 * mean, 1 / (255 * std)) as float32 [3, 1, 1] on ``device``, copied there once."""
    return torch.from_numpy(_MEAN_255).to(device), torch.from_numpy(_INV_STD_255).to(device)

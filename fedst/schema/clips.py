"""What a clip is and how it is augmented, as the config names them, without torch or
albumentations: :class:`ClipConfig` (``clip.*``: read by fedst/data/clips/) and
:class:`AugmentConfig` (``augment.*``: fedst/data/clips/augmentation.py builds its pipeline)."""

from __future__ import annotations

from dataclasses import dataclass

SINGLE_FRAME_MODES = ("repeat", "single")


@dataclass(frozen=True)
class ClipConfig:
    num_frames: int = 4
    """Frames per clip T, the current frame last (paper: 4)."""
    interval_s: float = 0.2
    """Seconds between consecutive clip frames (paper: 0.2)."""
    image_size: tuple[int, int] = (128, 160)
    """(H, W) network input size."""
    single_frame_mode: str = "repeat"
    """Image-only data (every video one frame): "repeat" the frame T times, or "single" (T = 1)."""

    def __post_init__(self) -> None:
        if self.num_frames < 1:
            raise ValueError(f"clip.num_frames must be >= 1, got {self.num_frames}")
        if self.interval_s < 0:
            raise ValueError(f"clip.interval_s must be >= 0, got {self.interval_s}")
        if len(self.image_size) != 2 or min(self.image_size) < 1:
            raise ValueError(f"clip.image_size must be (H, W) > 0, got {self.image_size}")
        if self.single_frame_mode not in SINGLE_FRAME_MODES:
            raise ValueError(
                f"clip.single_frame_mode must be one of {SINGLE_FRAME_MODES}, "
                f"got {self.single_frame_mode!r}"
            )


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

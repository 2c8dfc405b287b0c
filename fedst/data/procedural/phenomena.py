"""Generator versions 3 and 4's temporal phenomena (:data:`~fedst.data.procedural.sites.PHENOMENA`): the
instruments' speed, motion blur, cautery smoke, specular flashes and tissue folds that hide an
instrument for a moment. Each has its own random stream (seeded by (seed, site, video id, name)),
so switching one off leaves the others, and versions 1-2, as they were. Planned once per video
(:class:`VideoPhenomena`), then evaluated per frame time ``t``; what each one did to a frame is
returned beside the image as ground truth (:class:`FrameTruth`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedst.data.procedural.instruments import InstrumentPart, InstrumentTrack
from fedst.data.procedural.noise import seeded_rng, smoothstep, value_noise
from fedst.data.procedural.sites import FPS, PhenomenaStyle

SMOKE_VEILS = 0.35
"""Smoke opacity from which a pixel counts as degraded (its contrast cut by at least 35 %)."""
FLASH_BLINDS = 0.3
"""Added specular light (0..1 scale) from which a pixel counts as degraded."""
BLUR_SMEARS_PX = 3.0
"""Version 3: motion-blur length in pixels from which an instrument's pixels count as degraded."""
BLUR_CHANGES = 0.1
"""Version 4: mean absolute R, G, B change (0..1 scale) that motion blur makes to a pixel, from
which the pixel counts as degraded (docs/benchmark.md, "Version 4's criterion")."""
SMOKE_COLOUR = np.array([0.88, 0.86, 0.84], np.float32)
PLANNING_LEAD_S = 4.0
"""Events may start this long before the first frame, so a video can open inside one."""


@dataclass
class FrameTruth:
    """What the phenomena did to one frame, all [H, W] unless said otherwise."""

    tool_ids: np.ndarray
    """uint8: which instrument (1..n) the mask's label at each pixel belongs to; 0 elsewhere."""
    smoke: np.ndarray
    """float32 smoke opacity 0..1."""
    flash: np.ndarray
    """float32 added specular light."""
    occluded: np.ndarray
    """bool: instrument footprint hidden under a tissue fold (not labelled in the mask)."""
    blur_px: tuple[float, ...]
    """Motion-blur length of each instrument in pixels."""
    occluded_px: tuple[int, ...]
    """Pixels of each instrument's footprint hidden under tissue folds."""
    blur_change: np.ndarray | None = None
    """Version 4: float32 mean absolute R, G, B difference between the frame composed with motion
    blur and without it (before folds, flashes, smoke and the camera); ``None`` in version 3."""

    def causes(self, mask: np.ndarray) -> dict[str, np.ndarray]:
        """bool [H, W] per cause (smoke, flash, blur): the pixels it degrades, labelled or not.
        Blur: version 3, the whole footprint of an instrument blurred by >= BLUR_SMEARS_PX;
        version 4, the pixels the blur changed by >= BLUR_CHANGES."""
        if self.blur_change is not None:
            blurred = self.blur_change >= BLUR_CHANGES
        else:
            blurred = np.zeros(mask.shape, bool)
            for index, length in enumerate(self.blur_px, start=1):
                if length >= BLUR_SMEARS_PX:
                    blurred |= self.tool_ids == index
        return {
            "smoke": self.smoke >= SMOKE_VEILS,
            "flash": self.flash >= FLASH_BLINDS,
            "blur": blurred,
        }

    def degraded(self, mask: np.ndarray) -> np.ndarray:
        """bool [H, W]: labelled instrument pixels whose appearance is degraded (smoke, flash or
        motion blur, :meth:`causes`); the label there is still the truth."""
        smoke, flash, blur = self.causes(mask).values()
        return (smoke | flash | blur) & (mask > 0)


@dataclass(frozen=True)
class _Puff:
    start: float
    duration: float
    density: float
    radius: float
    centre: np.ndarray  # (2,) x, y where the cautery tip was
    drift: np.ndarray  # (2,) pixels per second
    texture: np.ndarray  # [H, W] 0..1


@dataclass(frozen=True)
class _Fold:
    tool: int
    start: float
    duration: float
    along: float  # anchor: joint + along * (jaw centre - joint)
    radius: float
    aspect: float
    texture: np.ndarray  # [H, W] zero-mean noise that roughens the fold's edge


def _jaw_centre(parts: list[InstrumentPart]) -> np.ndarray:
    return np.mean([p.polygon.mean(0) for p in parts[2:]], axis=0)


def _poisson_starts(rng: np.random.Generator, rate: float, begin: float, end: float) -> np.ndarray:
    count = rng.poisson(rate * (end - begin))
    return np.sort(rng.uniform(begin, end, count))


class VideoPhenomena:
    """The phenomena of one video: speeds set on the tracks, then events planned over its time."""

    def __init__(
        self,
        style: PhenomenaStyle,
        seed: int,
        site: str,
        video_id: str,
        tools: list[InstrumentTrack],
        height: int,
        width: int,
        time_offset: float,
        frames: int,
    ):
        self.style, self.tools, self.height, self.width = style, tools, height, width
        size = min(height, width)
        pixels_per_cm = style.pixels_per_cm(height, width)
        motion = seeded_rng(seed, site, video_id, "motion")
        for tool in tools:
            target = (
                pixels_per_cm
                * style.tip_speed_cm_s
                * math.exp(motion.normal(0.0, style.tip_speed_spread))
            )
            tool.motion_scale = target / max(tool.joint_rms_speed(), 1e-6)
        begin, end = time_offset - PLANNING_LEAD_S, time_offset + frames / FPS
        yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
        self.xx, self.yy = xx, yy

        smoke = seeded_rng(seed, site, video_id, "smoke")
        self.puffs: list[_Puff] = []
        for start in _poisson_starts(smoke, style.smoke_per_s, begin, end):
            tool = tools[int(smoke.integers(len(tools)))]
            self.puffs.append(
                _Puff(
                    start=float(start),
                    duration=float(smoke.uniform(*style.smoke_duration_s)),
                    density=float(smoke.uniform(*style.smoke_density)),
                    radius=float(smoke.uniform(*style.smoke_radius)) * size,
                    centre=_jaw_centre(tool.parts(float(start), (1.0, 1.0, 1.0))),
                    drift=np.array([smoke.uniform(-0.1, 0.1), smoke.uniform(-0.25, -0.05)]) * size,
                    texture=np.clip(0.5 + 0.25 * value_noise(smoke, height, width, 4, 2), 0, 1),
                )
            )

        occlusion = seeded_rng(seed, site, video_id, "occlusion")
        self.folds: list[_Fold] = []
        for index in range(len(tools)):
            for start in _poisson_starts(occlusion, style.occlusion_per_s, begin, end):
                self.folds.append(
                    _Fold(
                        tool=index,
                        start=float(start),
                        duration=float(occlusion.uniform(*style.occlusion_duration_s)),
                        along=float(occlusion.uniform(-0.8, 1.0)),
                        radius=float(occlusion.uniform(*style.occlusion_radius)) * size,
                        aspect=float(occlusion.uniform(1.2, 1.8)),
                        texture=value_noise(occlusion, height, width, 6, 2),
                    )
                )
        self.flashes = seeded_rng(seed, site, video_id, "flash")

    def blur_lengths(self, t: float) -> list[float]:
        """Each instrument's motion-blur length in pixels at ``t``: its joint's speed x exposure."""
        step = 0.01
        return [
            float(np.linalg.norm(tool.joint(t + step) - tool.joint(t - step)))
            / (2 * step)
            * self.style.exposure_s
            for tool in self.tools
        ]

    def exposure_times(self, t: float, blur_px: list[float]) -> list[float]:
        """Sub-frame times whose instruments, averaged, make the motion blur (``[t]`` if none)."""
        samples = min(9, 1 + math.ceil(max(blur_px, default=0.0)))
        if samples <= 2:
            return [t]
        half = self.style.exposure_s / 2
        return [t - half + 2 * half * k / (samples - 1) for k in range(samples)]

    def smoke_opacity(self, t: float) -> np.ndarray:
        """Smoke opacity [H, W] 0..1 at ``t``: each puff grows, drifts up and thins out."""
        clear = np.ones((self.height, self.width), np.float32)
        for puff in self.puffs:
            age = t - puff.start
            if not 0 <= age <= puff.duration:
                continue
            envelope = smoothstep(np.float32(age), 0.0, 0.4) * (
                1 - smoothstep(np.float32(age), 0.5 * puff.duration, puff.duration)
            )
            radius = puff.radius * (0.4 + 0.6 * smoothstep(np.float32(age), 0.0, 1.0))
            cx, cy = puff.centre + puff.drift * age
            distance2 = ((self.xx - cx) ** 2 + (self.yy - cy) ** 2) / (radius * radius)
            opacity = puff.density * envelope * np.exp(-distance2) * (0.6 + 0.4 * puff.texture)
            clear *= 1 - np.clip(opacity, 0, 0.95)
        return 1 - clear

    def fold_coverage(self, t: float, parts_per_tool: list[list[InstrumentPart]]) -> np.ndarray:
        """Coverage [H, W] 0..1 of the tissue folds over the instruments at ``t``; each fold is
        anchored on its instrument (it slides under the fold) and opens and closes in 0.2 s."""
        coverage = np.zeros((self.height, self.width), np.float32)
        for fold in self.folds:
            age = t - fold.start
            if not 0 <= age <= fold.duration:
                continue
            grow = smoothstep(np.float32(age), 0.0, 0.2) * smoothstep(
                np.float32(fold.duration - age), 0.0, 0.2
            )
            if grow <= 0:
                continue
            parts = parts_per_tool[fold.tool]
            joint = parts[1].origin
            centre = joint + fold.along * (_jaw_centre(parts) - joint)
            along_axis = parts[0].axis
            dx, dy = self.xx - centre[0], self.yy - centre[1]
            u = dx * along_axis[0] + dy * along_axis[1]
            v = -dx * along_axis[1] + dy * along_axis[0]
            radius = fold.radius * grow
            distance = np.sqrt((u / radius) ** 2 + (v / (radius * fold.aspect)) ** 2)
            distance += 0.12 * fold.texture
            coverage = np.maximum(coverage, np.clip((1.0 - distance) / 0.12, 0, 1))
        return coverage

    def flash_light(self, parts_per_tool: list[list[InstrumentPart]]) -> np.ndarray:
        """Added specular light [H, W] of this frame: a flash on an instrument's wrist or jaw with
        probability ``flash_per_s`` / fps per instrument (one draw per instrument per frame)."""
        light = np.zeros((self.height, self.width), np.float32)
        chance = self.style.flash_per_s / FPS
        for parts in parts_per_tool:
            draw = self.flashes.random(4)
            if draw[0] >= chance:
                continue
            part = parts[1 + int(draw[1] * (len(parts) - 1))]
            centre = part.polygon.mean(0)
            radius = (1.2 + 1.2 * draw[2]) * part.half_width
            peak = 0.8 + 0.6 * draw[3]
            distance2 = ((self.xx - centre[0]) ** 2 + (self.yy - centre[1]) ** 2) / radius**2
            light += peak * np.exp(-distance2)
        return light

"""The instruments, the same at every site up to a metal tint: their parts (rigid shaft, articulated
wrist, two-blade jaw; mask labels 1-3), their smooth pivoting motion from an image border
(:class:`InstrumentTrack`), and their drawing: every part one polygon rasterised into the image
(anti-aliased, cylinder-shaded) and into the mask (exact), image-only details, and the soft shadow
the instruments cast on the tissue."""

from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np

from fedst.data.procedural.noise import Sinusoids
from fedst.data.procedural.sites import RGB

SHAFT, WRIST, JAW = 1, 2, 3

# Metal appearance, shared by all sites (RGB 0..1) and instrument kinds (jaw length, blade width
# relative to the shaft width).
SHAFT_COLOUR: RGB = (0.20, 0.20, 0.22)
WRIST_COLOUR: RGB = (0.62, 0.62, 0.64)
JAW_COLOUR: RGB = (0.66, 0.66, 0.68)
INSTRUMENT_KINDS: dict[str, tuple[float, float]] = {
    "grasper": (1.6, 0.62),
    "needle_driver": (1.3, 0.72),
    "scissors": (1.9, 0.50),
}


@dataclass(frozen=True)
class InstrumentPart:
    """One rigid polygon of an instrument and the axis used for its cylinder shading."""

    label: int
    polygon: np.ndarray  # (N, 2) float x, y in pixels
    origin: np.ndarray  # (2,)
    axis: np.ndarray  # (2,) unit vector along the part
    half_width: float
    colour: RGB


def _unit(angle: float) -> np.ndarray:
    return np.array([math.cos(angle), math.sin(angle)])


def _capsule(start: np.ndarray, end: np.ndarray, width: float, rounded: bool) -> np.ndarray:
    """Polygon (N, 2) of a bar from ``start`` to ``end``, optionally with a rounded far end."""
    direction = end - start
    angle = math.atan2(direction[1], direction[0])
    normal = _unit(angle + math.pi / 2) * width / 2
    if not rounded:
        return np.stack([start + normal, end + normal, end - normal, start - normal])
    arc = [
        end + _unit(a) * width / 2 for a in np.linspace(angle + math.pi / 2, angle - math.pi / 2, 9)
    ]
    return np.stack([start + normal, *arc, start - normal])


class InstrumentTrack:
    """One instrument entering from the image border, with smooth pivoting motion."""

    def __init__(self, rng: np.random.Generator, height: int, width: int, moving: bool):
        size = min(height, width)
        self.shaft_width = rng.uniform(0.10, 0.14) * size
        self.kind = str(rng.choice(list(INSTRUMENT_KINDS)))
        side = rng.choice(["left", "right", "bottom", "top"], p=[0.35, 0.35, 0.2, 0.1])
        base_angle = {"left": math.pi, "right": 0.0, "bottom": math.pi / 2, "top": -math.pi / 2}
        self.pivot_angle = base_angle[side] + rng.uniform(-0.6, 0.6)
        radius = 0.9 * math.hypot(height, width)
        centre = np.array([(width - 1) / 2, (height - 1) / 2])
        self.pivot = centre + radius * _unit(self.pivot_angle)
        # Joint rest position: in the half of the image facing the pivot, not too close to border.
        toward = _unit(self.pivot_angle) * np.array([width, height]) * rng.uniform(0.05, 0.3)
        self.rest = centre + toward + rng.uniform(-0.15, 0.15, 2) * np.array([width, height])
        amp = 0.22 * size if moving else 0.0
        self.dx, self.dy = Sinusoids(rng, amp, 0.12), Sinusoids(rng, amp, 0.12)
        self.motion_scale = 1.0
        """Time factor of the joint's translation (version 3 sets it from a target speed)."""
        self.jitter = rng.uniform(-0.25, 0.25, 2) * np.array([width, height]) * (not moving)
        self.wrist_rest = rng.uniform(-0.7, 0.7)
        self.wrist = Sinusoids(rng, 0.5 if moving else 0.0, 0.2)
        self.jaw_pitch = Sinusoids(rng, 0.4 if moving else 0.0, 0.25)
        self.open_phase = rng.uniform(0, 2 * math.pi)
        self.open_hz = rng.uniform(0.1, 0.3) if moving else 0.0
        self.open_static = rng.uniform(0, 1)

    def joint(self, t: float) -> np.ndarray:
        """Position (x, y) of the shaft's end, where the wrist starts, at time ``t``."""
        motion_t = t * self.motion_scale
        return self.rest + self.jitter + np.array([self.dx(motion_t), self.dy(motion_t)])

    def joint_rms_speed(self) -> float:
        """Root-mean-square speed of the joint in pixels per second at ``motion_scale`` 1."""
        return math.sqrt(
            0.5 * sum(float(np.sum((s.amps * s.freqs) ** 2)) for s in (self.dx, self.dy))
        )

    def parts(self, t: float, tint: RGB) -> list[InstrumentPart]:
        """Shaft, wrist and jaw blades at time ``t`` (seconds), in draw order."""
        joint = self.joint(t)
        axis = joint - self.pivot
        shaft_angle = math.atan2(axis[1], axis[0])
        w = self.shaft_width
        wrist_angle = shaft_angle + self.wrist_rest + self.wrist(t)
        wrist_end = joint + _unit(wrist_angle) * 1.5 * w
        jaw_angle = wrist_angle + self.jaw_pitch(t)
        if self.open_hz:
            opening = 0.5 + 0.5 * math.sin(2 * math.pi * self.open_hz * t + self.open_phase)
        else:
            opening = self.open_static
        half_open = 0.05 + 0.32 * opening
        jaw_length, blade_width = INSTRUMENT_KINDS[self.kind]
        parts = [
            InstrumentPart(
                label=SHAFT,
                polygon=_capsule(self.pivot, joint, w, False),
                origin=joint,
                axis=_unit(shaft_angle),
                half_width=w / 2,
                colour=_tinted(SHAFT_COLOUR, tint),
            ),
            InstrumentPart(
                label=WRIST,
                polygon=_capsule(joint - _unit(wrist_angle) * 0.35 * w, wrist_end, 0.9 * w, True),
                origin=joint,
                axis=_unit(wrist_angle),
                half_width=0.45 * w,
                colour=_tinted(WRIST_COLOUR, tint),
            ),
        ]
        for sign in (-1.0, 1.0):
            angle = jaw_angle + sign * half_open
            base = wrist_end + _unit(jaw_angle + sign * math.pi / 2) * 0.12 * w
            tip = base + _unit(angle) * jaw_length * w
            normal = _unit(angle + math.pi / 2)
            bw = blade_width * w
            polygon = np.stack(
                [
                    base + normal * bw / 2,
                    tip + normal * bw * 0.22,
                    tip - normal * bw * 0.22,
                    base - normal * bw / 2,
                ]
            )
            parts.append(
                InstrumentPart(JAW, polygon, base, _unit(angle), bw / 2, _tinted(JAW_COLOUR, tint))
            )
        return parts


def _tinted(colour: RGB, tint: RGB) -> RGB:
    return (colour[0] * tint[0], colour[1] * tint[1], colour[2] * tint[2])


def fill_footprint(layer: np.ndarray, part: InstrumentPart, value: int) -> np.ndarray:
    """Set ``layer`` [H, W] to ``value`` on ``part``'s exact footprint (the mask's rasterisation);
    returns its vertices (4 fractional bits, shift=4)."""
    vertices = np.round(part.polygon * 16).astype(np.int32)
    cv2.fillPoly(layer, [vertices], value, cv2.LINE_8, shift=4)
    return vertices


def draw_part(image: np.ndarray, mask: np.ndarray, part: InstrumentPart, cartoon: bool) -> None:
    """Rasterise ``part`` into ``image`` [H, W, 3] (anti-aliased, shaded) and ``mask`` [H, W]."""
    height, width = mask.shape
    vertices = fill_footprint(mask, part, int(part.label))
    x0, y0 = np.floor(part.polygon.min(0)).astype(int) - 1
    x1, y1 = np.ceil(part.polygon.max(0)).astype(int) + 2
    x0, y0, x1, y1 = max(x0, 0), max(y0, 0), min(x1, width), min(y1, height)
    if x0 >= x1 or y0 >= y1:
        return
    coverage = np.zeros((y1 - y0, x1 - x0), np.uint8)
    cv2.fillPoly(coverage, [vertices - np.array([x0, y0]) * 16], 255, cv2.LINE_AA, shift=4)
    alpha = coverage.astype(np.float32)[..., None] / 255.0  # (h, w, 1)
    yy, xx = np.mgrid[y0:y1, x0:x1].astype(np.float32)
    normal = np.array([-part.axis[1], part.axis[0]])
    across = (xx - part.origin[0]) * normal[0] + (yy - part.origin[1]) * normal[1]
    s = np.clip(across / part.half_width, -1, 1)  # position across the cylinder, -1..1
    nz = np.sqrt(1 - s * s)
    colour = np.asarray(part.colour, np.float32)
    if cartoon:
        shade = np.where(s < 0.15, 1.0, 0.65)[..., None]
        pixels = colour * shade + (0.25 * (s > -0.55) * (s < -0.25))[..., None]
    else:
        # Light slightly off-axis: normal (s*n, nz) against light (-0.35 across, 0.94 towards cam).
        diffuse = np.clip(-0.35 * s + 0.94 * nz, 0, 1)
        highlight = np.clip(-0.18 * s + 0.98 * nz, 0, 1) ** 40
        pixels = colour * (0.35 + 0.75 * diffuse)[..., None] + (0.75 * highlight)[..., None]
    region = image[y0:y1, x0:x1]
    region[:] = region * (1 - alpha) + np.clip(pixels, 0, 1) * alpha
    if cartoon:
        cv2.polylines(image, [vertices], True, (0.05, 0.05, 0.05), 1, cv2.LINE_AA, shift=4)


def draw_details(image: np.ndarray, parts: list[InstrumentPart]) -> None:
    """Image-only details inside the drawn parts: a ring at the shaft end and a wrist pin."""
    shaft, wrist = parts[0], parts[1]
    ring_centre = shaft.origin - shaft.axis * 0.5 * shaft.half_width * 2
    normal = np.array([-shaft.axis[1], shaft.axis[0]]) * shaft.half_width * 0.92
    ends = np.round(np.stack([ring_centre + normal, ring_centre - normal]) * 16).astype(np.int32)
    thickness = max(1, round(shaft.half_width * 0.25))
    cv2.polylines(image, [ends], False, (0.55, 0.55, 0.57), thickness, cv2.LINE_AA, shift=4)
    pin = np.round(wrist.origin * 16).astype(np.int32)
    radius = max(1, round(wrist.half_width * 0.35 * 16))
    cv2.circle(image, tuple(int(v) for v in pin), radius, (0.3, 0.3, 0.32), -1, cv2.LINE_AA, 4)


def instrument_shadow(
    parts_per_tool: list[list[InstrumentPart]], height: int, width: int
) -> np.ndarray:
    """Soft shadow [H, W] in 0..1 cast by the instruments onto the tissue."""
    layer = np.zeros((height, width), np.float32)
    offset = np.array([0.035 * width, 0.05 * height])
    for parts in parts_per_tool:
        for part in parts:
            vertices = np.round((part.polygon + offset) * 16).astype(np.int32)
            cv2.fillPoly(layer, [vertices], 1.0, cv2.LINE_AA, shift=4)
    return cv2.GaussianBlur(layer, (0, 0), 0.03 * height + 0.5)

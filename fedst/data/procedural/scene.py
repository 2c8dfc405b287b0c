"""The tissue background of a video: a canvas larger than the frame (multi-octave value noise
coloured by the site's tissue family, patches, vessel trees, a height field; plus the version-2
clutter from its own random stream), warped per frame by a smooth camera drift and a slow
non-rigid deformation, and shaded wet (Lambert + Phong with specular highlights) or flat for the
cartoon site."""

from __future__ import annotations

import math

import cv2
import numpy as np

from fedst.data.procedural.noise import Sinusoids, mix_colour, smoothstep, value_noise
from fedst.data.procedural.sites import CLUTTER, ClutterStyle, SiteStyle, TissueStyle


class TissueScene:
    """A tissue canvas with per-frame camera drift, non-rigid deformation and wet shading."""

    def __init__(
        self,
        rng: np.random.Generator,
        style: SiteStyle,
        height: int,
        width: int,
        clutter_rng: np.random.Generator | None = None,
    ):
        """``clutter_rng``: add :data:`CLUTTER` from this stream (version 2); ``rng`` draws the
        same numbers either way, so version 1's videos do not change."""
        self.style, self.height, self.width = style, height, width
        tissue = style.tissue
        self.pad = pad = round(0.22 * max(height, width))
        ch, cw = height + 2 * pad, width + 2 * pad
        self.albedo, self.relief = self._canvas(rng, tissue, ch, cw, height)
        if clutter_rng is not None and not style.cartoon:
            self.albedo, self.relief = _add_clutter(
                clutter_rng, CLUTTER, self.albedo, self.relief, height
            )

        moving = not style.independent_frames
        drift = 0.5 * pad if moving else 0.0
        self.shift_x = Sinusoids(rng, drift, 0.08)
        self.shift_y = Sinusoids(rng, drift, 0.08)
        self.rotation = Sinusoids(rng, 0.06 if moving else 0.0, 0.05)
        self.zoom = Sinusoids(rng, 0.05 if moving else 0.0, 0.05)
        wobble = 0.02 * max(height, width) if moving else 0.0
        self.deform_fields = [
            cv2.GaussianBlur(value_noise(rng, height, width, 3, 1), (0, 0), 2) for _ in range(4)
        ]
        self.deform = [Sinusoids(rng, wobble, 0.3, terms=2) for _ in range(4)]
        yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
        self.xc, self.yc = xx - (width - 1) / 2, yy - (height - 1) / 2

    @staticmethod
    def _canvas(
        rng: np.random.Generator, tissue: TissueStyle, ch: int, cw: int, frame_h: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Albedo [ch, cw, 3] and relief [ch, cw, 2] (fold height, fine wet bumps) of the tissue."""
        scale = ch / frame_h
        broad = value_noise(rng, ch, cw, 2.5 * scale, 3)
        mid = value_noise(rng, ch, cw, 6 * scale, 3, stretch=1 / tissue.stretch)
        fine = value_noise(rng, ch, cw, 24 * scale, 2, stretch=1 / tissue.stretch)
        albedo = np.empty((ch, cw, 3), np.float32)
        albedo[:] = tissue.base
        albedo = mix_colour(albedo, tissue.dark, 0.9 * smoothstep(broad + 0.4 * mid, -0.4, 1.6))
        patch_field = value_noise(rng, ch, cw, 3 * scale, 3) + 0.25 * fine
        threshold = float(np.quantile(patch_field, 1 - tissue.patch_share))
        patches = 0.8 * smoothstep(patch_field, threshold - 0.35, threshold + 0.5)
        albedo = mix_colour(albedo, tissue.patch, patches)
        albedo *= (1.0 + 0.12 * tissue.roughness * (0.6 * mid + 0.6 * fine))[..., None]

        relief = tissue.folds * (1.3 * broad + 0.5 * mid) + 0.2 * tissue.roughness * fine
        relief += 0.25 * patches
        if tissue.cells > 0:
            network = np.abs(value_noise(rng, ch, cw, 14 * scale, 1))
            lines = 1.0 - smoothstep(network, 0.0, 0.18)
            albedo = mix_colour(albedo, tissue.dark, tissue.cells * 0.6 * lines)
            relief -= 0.3 * tissue.cells * lines
        if tissue.speckle > 0:
            dots = value_noise(rng, ch, cw, 40 * scale, 1) + 0.8 * mid
            cutoff = float(np.quantile(dots, 1 - tissue.speckle))
            speckles = smoothstep(dots, cutoff, cutoff + 0.3)
            albedo = mix_colour(albedo, (0.12, 0.11, 0.13), 0.85 * speckles)

        vessels = np.zeros((ch, cw), np.float32)
        for _ in range(tissue.vessels):
            _draw_vessel_tree(rng, vessels, frame_h)
        vessels = cv2.GaussianBlur(vessels, (0, 0), max(0.7, frame_h / 110))
        albedo = mix_colour(albedo, tissue.vessel, np.clip(vessels, 0, 1) * 0.6)
        relief += 0.3 * vessels
        # Fine wet bumps: only shape the specular highlights (see _shade).
        wet = smoothstep(value_noise(rng, ch, cw, 2 * scale, 2), 0.2, 1.6)
        bumps = value_noise(rng, ch, cw, 9 * scale, 2) * wet
        relief = np.stack([relief, bumps], axis=-1)  # (ch, cw, 2)
        return np.clip(albedo, 0, 1), relief.astype(np.float32)

    def render(self, t: float) -> np.ndarray:
        """Shaded tissue [H, W, 3] float32 in 0..1 at time ``t`` (seconds)."""
        angle, zoom = self.rotation(t), 1.0 + self.zoom(t)
        cos_a, sin_a = math.cos(angle) / zoom, math.sin(angle) / zoom
        map_x = cos_a * self.xc - sin_a * self.yc + (self.width - 1) / 2 + self.pad
        map_y = sin_a * self.xc + cos_a * self.yc + (self.height - 1) / 2 + self.pad
        map_x += self.shift_x(t)
        map_y += self.shift_y(t)
        for i, (field, signal) in enumerate(zip(self.deform_fields, self.deform, strict=True)):
            if i % 2 == 0:
                map_x += signal(t) * field
            else:
                map_y += signal(t) * field
        warp = np.dstack([self.albedo, self.relief])  # (ch, cw, 5)
        surface = cv2.remap(warp, map_x, map_y, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT)
        albedo, relief, bumps = surface[..., :3], surface[..., 3], surface[..., 4]  # (H, W, ...)
        return self._shade(albedo, relief, bumps)

    def _shade(self, albedo: np.ndarray, relief: np.ndarray, bumps: np.ndarray) -> np.ndarray:
        """Lambert + Phong shading of the warped surface [H, W] with a light at the camera."""
        tissue = self.style.tissue
        strength = 0.09 * self.height / 128
        gx = cv2.Sobel(relief, cv2.CV_32F, 1, 0, ksize=3) * strength
        gy = cv2.Sobel(relief, cv2.CV_32F, 0, 1, ksize=3) * strength
        inv = 1.0 / np.sqrt(gx * gx + gy * gy + 1.0)
        light = np.array([0.25, -0.35, 1.0], np.float32)
        light /= np.linalg.norm(light)
        diffuse = np.clip((-gx * light[0] - gy * light[1] + light[2]) * inv, 0, 1)
        if self.style.cartoon:
            diffuse = np.floor(diffuse * 4.0) / 4.0 + 0.12
            return np.clip(albedo * (0.35 + 0.65 * diffuse)[..., None], 0, 1)
        # Wet surface: the specular normal also follows the fine bumps.
        bump_strength = 0.04 * self.height / 128
        sx = gx + cv2.Sobel(bumps, cv2.CV_32F, 1, 0, ksize=3) * bump_strength
        sy = gy + cv2.Sobel(bumps, cv2.CV_32F, 0, 1, ksize=3) * bump_strength
        half = light + np.array([0, 0, 1], np.float32)
        half /= np.linalg.norm(half)
        facing = (-sx * half[0] - sy * half[1] + half[2]) / np.sqrt(sx * sx + sy * sy + 1.0)
        spec = np.clip(facing, 0, 1) ** 150
        shaded = albedo * (0.1 + 1.0 * diffuse**1.5)[..., None] + tissue.gloss * spec[..., None]
        return np.clip(shaded, 0, 1)


def _add_clutter(
    rng: np.random.Generator,
    clutter: ClutterStyle,
    albedo: np.ndarray,
    relief: np.ndarray,
    frame_h: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Version 2: this video's tissue saturation and brightness, fascia sheets and cautery marks
    on a canvas's albedo [ch, cw, 3] and relief [ch, cw, 2] (fold height, wet bumps)."""
    ch, cw = albedo.shape[:2]
    scale = ch / frame_h
    luminance = albedo @ np.array([0.299, 0.587, 0.114], np.float32)
    saturation = rng.uniform(*clutter.saturation)
    albedo = luminance[..., None] + saturation * (albedo - luminance[..., None])
    albedo = albedo * rng.uniform(*clutter.brightness)

    sheet_field = value_noise(rng, ch, cw, 2.5 * scale, 3, stretch=0.6)
    streaks = value_noise(rng, ch, cw, 10 * scale, 2, stretch=0.35)
    cutoff = float(np.quantile(sheet_field, 1 - clutter.fascia_share))
    sheets = smoothstep(sheet_field, cutoff - 0.2, cutoff + 0.4) * np.clip(
        0.75 + 0.2 * streaks, 0, 1
    )
    albedo = mix_colour(albedo, clutter.fascia, sheets)

    marks = value_noise(rng, ch, cw, 18 * scale, 2) + 0.6 * value_noise(rng, ch, cw, 4 * scale, 1)
    cutoff = float(np.quantile(marks, 1 - clutter.char_share))
    char = smoothstep(marks, cutoff, cutoff + 0.25)
    albedo = mix_colour(albedo, clutter.char, 0.9 * char)

    relief[..., 0] += 0.2 * sheets - 0.2 * char  # the scene's own canvas: changed in place
    return np.clip(albedo, 0, 1).astype(np.float32), relief


def _draw_vessel_tree(rng: np.random.Generator, layer: np.ndarray, frame_h: int) -> None:
    """Random-walk vessels with branches, drawn into ``layer`` [H, W] (1 = vessel)."""
    h, w = layer.shape
    stack = [
        (
            rng.uniform(0, w),
            rng.uniform(0, h),
            rng.uniform(0, 2 * math.pi),
            rng.uniform(1.5, 3.0) * frame_h / 128,
        )
    ]
    step = 0.035 * frame_h
    branches = 0
    while stack:
        x, y, heading, thickness = stack.pop()
        points = [(x, y)]
        for _ in range(rng.integers(8, 22)):
            heading += rng.normal(0, 0.15)
            x, y = x + step * math.cos(heading), y + step * math.sin(heading)
            points.append((x, y))
            if branches < 3 and thickness > 1.0 and rng.random() < 0.05:
                branches += 1
                stack.append(
                    (x, y, heading + rng.choice([-1, 1]) * rng.uniform(0.4, 1.0), thickness * 0.65)
                )
        pts = np.round(np.asarray(points) * 16).astype(np.int32)[None]
        cv2.polylines(layer, pts, False, 1.0, max(1, round(thickness)), cv2.LINE_AA, shift=4)

"""The randomness every video is built from: a numpy Generator per (seed, keys) from SHA-256 (never
global state or Python's hash), fractal value noise, smoothstep and colour mixing for the
textures, and sums of low-frequency sinusoids for smooth motion (continuous velocity)."""

from __future__ import annotations

import hashlib
import math

import cv2
import numpy as np

from fedst.data.procedural.sites import RGB


def seeded_rng(seed: int, *keys: str) -> np.random.Generator:
    """A Generator determined by ``seed`` and string ``keys`` (SHA-256, not Python's hash)."""
    digest = hashlib.sha256("/".join([str(seed), *keys]).encode()).digest()
    return np.random.default_rng(np.frombuffer(digest, dtype=np.uint32))


def value_noise(
    rng: np.random.Generator,
    height: int,
    width: int,
    cells: float,
    octaves: int,
    persistence: float = 0.5,
    stretch: float = 1.0,
) -> np.ndarray:
    """Fractal value noise [H, W] float32, zero mean and unit std; ``cells`` along the long side."""
    total = np.zeros((height, width), np.float32)
    amplitude = 1.0
    long_side = max(height, width)
    for octave in range(octaves):
        n = cells * 2**octave
        grid_h = max(2, round(n * height / long_side * stretch) + 2)
        grid_w = max(2, round(n * width / long_side) + 2)
        grid = rng.random((grid_h, grid_w), dtype=np.float32)
        total += amplitude * cv2.resize(grid, (width, height), interpolation=cv2.INTER_CUBIC)
        amplitude *= persistence
    total -= total.mean()
    return total / (total.std() + 1e-6)


def smoothstep(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    t = np.clip((x - lo) / (hi - lo), 0.0, 1.0)
    return t * t * (3.0 - 2.0 * t)


def mix_colour(a: np.ndarray, colour: RGB, weight: np.ndarray) -> np.ndarray:
    """Blend image ``a`` [H, W, 3] towards ``colour`` by ``weight`` [H, W]."""
    w = weight[..., None]
    return a * (1.0 - w) + np.asarray(colour, np.float32) * w


class Sinusoids:
    """A smooth scalar signal: sum of sinusoids with random frequencies (continuous velocity)."""

    def __init__(self, rng: np.random.Generator, amplitude: float, max_hz: float, terms: int = 3):
        self.freqs = rng.uniform(0.25, 1.0, terms) * max_hz * 2 * math.pi
        self.phases = rng.uniform(0, 2 * math.pi, terms)
        weights = rng.uniform(0.5, 1.0, terms)
        self.amps = amplitude * weights / weights.sum()

    def __call__(self, t: float) -> float:
        return float(np.sum(self.amps * np.sin(self.freqs * t + self.phases)))

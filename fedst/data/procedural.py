"""Procedural multi-site surgical video benchmark, written in the generic layout (DESIGN.md sec. 5).

No surgical dataset can be downloaded here, so this module renders a deterministic stand-in for the
paper's federation (Table I): sites that differ in **tissue background** (palette, texture,
vessels, deformation, camera and lighting) while the **instruments** (rigid shaft, articulated
wrist, two-blade jaw; their geometry, shading and motion statistics) are shared up to a small
per-site metal tint, as between two robots.

Sites (:data:`SITES`): A and B nephrectomy-like (same renal tissue family, different camera,
lighting and metal tone, like EndoVis2017 vs 2018), C prostatectomy-like (sparse labels like
SAR-RARP50: every 2nd frame), D hysterectomy-like with little training data and a circular
endoscope field of view, E lobectomy-like with a lung background no other site uses (test only,
out of federation), ``synthetic`` (SISVSE stand-in for the server: cartoon shading, another
palette, independent single-frame "videos") and ``grasp`` (binary GraSP stand-in, prostatectomy-like
background, masks 0/1, test only).

Layout written per site (reference/datasets.md, D/E)::

    <out>/<site>/meta.json        fps, annotated_fps, classes, ignore_index, surgery_type, binary,
                                  generator {seed, preset, version}; written LAST (site complete)
    <out>/<site>/videos/<video_id>/frames/<frame_index:09d>.png     RGB
    <out>/<site>/videos/<video_id>/masks/<frame_index:09d>.png      uint8 0..3 (binary: 0/1)
    <out>/<site>/splits/{train,val,test}.txt                        one video_id per line

A binary site's ``classes`` are ``["background", "instrument"]`` (what the generic loader expects).
Frame index = index in the source video at ``fps`` = 5; a site with ``label_every`` = k > 1 has
masks only on frames whose index is a multiple of k (``annotated_fps`` = fps / k), so clip loaders
meet unlabelled intermediate frames.

Rendering, per video (everything from ``numpy`` Generators seeded by SHA-256 of (seed, site,
video_id); never global state): a tissue canvas larger than the frame (multi-octave value noise
coloured by the site palette, vessels, height field for wet Phong shading and specular highlights)
is warped per frame by a smooth camera drift plus a slow non-rigid deformation (breathing), then
1-3 instruments are drawn (shadow, then shaft, wrist, jaw of each instrument in depth order). Every
part is one polygon rasterised with ``cv2.fillPoly`` from the same vertices into the image
(anti-aliased coverage) and into the mask (exact), so labels follow the draw order. Trajectories
are sums of low-frequency sinusoids (continuous velocity). A per-site camera (tint, gain, gamma,
vignetting, sensor noise) is applied last. Outside site D's circular field of view nothing is
visible, so its masks are 0 there.

Presets (:data:`PRESETS`): videos x frames per video for train / val / test; C labels every 2nd
frame (labelled frames in brackets); E and grasp are test only; synthetic holds single images.

* tiny, 64 x 80: A, B 2x6 / 1x6 / 1x6; C 2x6 / 1x6 / 1x6 [3 per video]; D 1x6 / 1x6 / 1x6;
  E, grasp 2x6; synthetic 12. 126 frames; unit tests.
* demo, 128 x 160: A, B 4x25 / 1x25 / 2x25; C 4x50 / 1x50 / 2x50 [25 per video]; D (limited data)
  1x25 / 1x25 / 2x25; E, grasp 2x25; synthetic 200. 1100 frames; the laptop federated demo.
* full, 256 x 320, labelled train / test frames as in the paper's Table I: A 8x225 / 1x75 / 4x150
  (1800 / 600), B 15x149 / 1x75 / 4x249 (2235 / 996), C 7x578 / 1x150 / 6x380 [2023 / 1140],
  D 2x499 / 1x100 / 2x491 (998 / 982), E 1x203, grasp 5x60, synthetic 3600. Val videos are extra.
* paper_scale, 512 x 640: A, B, D 1x24 / 1x8 / 1x16; C 1x48 / 1x16 / 1x32 [half labelled];
  E, grasp 1x16; synthetic 3600 (SISVSE's count). The time and memory of a paper-size round
  (bench/paper_scale.py), not a benchmark to score.

Generation time, measured with ``python bench/data_generation.py`` (2 worker processes, on the
shared 2-core machine): tiny 0.7 s (180 frames/s) and demo 8.0 s (138 frames/s) at load average
~6; demo took 25 s at load ~8. Full (18440 frames) was not run; E + grasp of full (503 frames at
256 x 320) took 11.9 s (42 frames/s), so full takes roughly 7-8 minutes.

Diagnosis only (issue 15), the E-like *training* videos of an oracle:

    python -m fedst.data.procedural --out data/procedural/demo_oracle --preset demo --oracle-split E

writes ``<out>/E_oracle``, E-like training videos (E's
style, video ids ``oracle_000``... so other random streams than E's test videos ``video_*``) in the
train / val / test sizes of site A of the preset, for an oracle trained on E's domain (issue 15).
It is refused inside a benchmark folder and is never part of one, so no federation reads it unless a
config names it explicitly. The benchmark's own sites and their bytes do not change.

Generator versions (:data:`GENERATOR_VERSIONS`, ``--version`` / ``data.generator_version``), the
changelog:

* 1 (until issue 15): as above. Every A-D tissue is saturated red, pink or purple, so "grey or
  pale" alone told metal from tissue; E's pale lung was read as instrument by every model trained
  on A-D (E Dice 10-17 for all methods, while an oracle trained on E-like videos reached 83).
  Reproducible as ``data=demo_v1`` (``data/procedural/demo_v1``).
* 2 (default): version 1 plus :data:`CLUTTER` on every non-cartoon site, drawn from its own
  random stream so instruments, motion, masks and sensor noise are those of version 1: per-video
  tissue saturation and brightness (patients, irrigation), pale fascia sheets and dark cautery
  marks, as real surgical scenes hold. The server's cartoon set is unchanged.

Bump :data:`GENERATOR_VERSION` (and add a line above) whenever the rendering changes; keep every
older version rendered bit for bit (tests/test_generator_versions.py). Existing sites are never
deleted silently: a site whose meta.json matches (seed, preset, version) is skipped, one that
differs stops generation with the difference named (``--force`` / ``regenerate=true`` regenerates
on purpose).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import multiprocessing
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

try:
    import fcntl
except ImportError:  # Windows: generation is not locked across processes
    fcntl = None

from fedst.data.base import CLASS_NAMES, IGNORE_INDEX, SPLITS, DataError
from fedst.progress import progress_bar

__all__ = [
    "CLUTTER",
    "FPS",
    "GENERATOR_VERSION",
    "GENERATOR_VERSIONS",
    "LOCK_FILE",
    "PRESETS",
    "SITES",
    "ClutterStyle",
    "Preset",
    "SiteSize",
    "SiteStyle",
    "SplitSize",
    "generate",
    "generate_oracle_split",
    "main",
    "oracle_site_name",
    "render_video",
    "video_ids",
]

logger = logging.getLogger(__name__)

GENERATOR_VERSION = 2
"""The rendering written by default; :data:`GENERATOR_VERSIONS` lists every version still rendered."""
GENERATOR_VERSIONS: dict[int, str] = {
    1: "sites differ in tissue family and camera; every A-D tissue is a saturated red / pink / "
    "purple, so a grey or pale region is always metal (the shortcut that kept site E at the floor)",
    2: "version 1 plus surgical clutter in every non-cartoon site (:data:`CLUTTER`): per-video "
    "tissue saturation and brightness (patients, irrigation), pale fascia sheets and dark cautery "
    "marks; version 1's random streams and bytes are unchanged (tests/test_generator_versions.py)",
}
FPS = 5
PNG_PARAMS = (cv2.IMWRITE_PNG_COMPRESSION, 3)
BINARY_CLASSES = ("background", "instrument")
SHAFT, WRIST, JAW = 1, 2, 3

RGB = tuple[float, float, float]


# --------------------------------------------------------------------------------------------
# Site styles
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TissueStyle:
    """One background family: colours (RGB 0..1) and texture statistics of the tissue."""

    family: str
    """Name of the tissue family; sites sharing it differ only in camera and seeds."""
    base: RGB
    """Dominant tissue colour."""
    dark: RGB
    """Colour of deeper / more perfused tissue, mixed in by low-frequency noise."""
    patch: RGB
    """Colour of large patches (fat, fascia, lung pleura), placed by a thresholded noise field."""
    vessel: RGB
    """Colour of the vessels drawn on the surface."""
    patch_share: float
    """Approximate fraction of the canvas covered by patches."""
    vessels: int
    """Number of vessel trees per canvas."""
    roughness: float
    """Relative strength of the fine texture (0 smooth .. 1 rough)."""
    folds: float
    """Height amplitude of tissue folds (shapes the diffuse shading)."""
    gloss: float
    """Specular highlight strength (wet tissue)."""
    speckle: float
    """Fraction of the surface with small dark dots (lung anthracosis); 0 for none."""
    cells: float
    """Strength of a lobular network of thin lines (lung); 0 for none."""
    stretch: float
    """Anisotropy of the texture (> 1: fibres along x)."""


@dataclass(frozen=True)
class CameraStyle:
    """Per-site camera / light source applied to the whole composed frame."""

    tint: RGB = (1.0, 1.0, 1.0)
    """White-balance multipliers."""
    gain: float = 1.0
    """Global brightness multiplier."""
    gamma: float = 1.0
    """Output gamma (< 1 brighter mid-tones)."""
    vignette: float = 0.0
    """Radial light fall-off strength (0 none)."""
    light_offset: tuple[float, float] = (0.0, 0.0)
    """Light-spot centre offset as a fraction of (W, H) from the image centre."""
    noise: float = 0.0
    """Sensor noise standard deviation in 0..255 units."""
    blur: float = 0.0
    """Gaussian blur sigma in pixels at 128 px frame height (0 none)."""
    fov_radius: float = 0.0
    """Radius of a circular endoscope field of view, relative to the frame diagonal (0 none)."""


@dataclass(frozen=True)
class SiteStyle:
    """Everything that makes a site look like itself."""

    name: str
    surgery_type: str
    description: str
    tissue: TissueStyle
    camera: CameraStyle
    metal_tint: RGB = (1.0, 1.0, 1.0)
    """Small multiplicative tint of the instrument metal (robot generation / vendor)."""
    binary: bool = False
    """Masks hold 0 background / 1 instrument instead of parts."""
    cartoon: bool = False
    """Flat, posterised shading with outlines (synthetic-data style gap)."""
    independent_frames: bool = False
    """Each video is a single unrelated frame (no temporal neighbours)."""


RENAL = TissueStyle(
    family="renal",
    base=(0.72, 0.28, 0.26),
    dark=(0.45, 0.10, 0.10),
    patch=(0.86, 0.70, 0.42),
    vessel=(0.42, 0.06, 0.12),
    patch_share=0.22,
    vessels=7,
    roughness=0.55,
    folds=1.0,
    gloss=0.8,
    speckle=0.0,
    cells=0.0,
    stretch=1.0,
)
PELVIC = TissueStyle(
    family="pelvic",
    base=(0.86, 0.55, 0.50),
    dark=(0.62, 0.18, 0.18),
    patch=(0.93, 0.85, 0.80),
    vessel=(0.55, 0.08, 0.12),
    patch_share=0.20,
    vessels=4,
    roughness=0.7,
    folds=0.7,
    gloss=0.6,
    speckle=0.0,
    cells=0.0,
    stretch=1.8,
)
UTERINE = TissueStyle(
    family="uterine",
    base=(0.70, 0.32, 0.46),
    dark=(0.50, 0.20, 0.38),
    patch=(0.86, 0.60, 0.70),
    vessel=(0.36, 0.10, 0.30),
    patch_share=0.08,
    vessels=3,
    roughness=0.25,
    folds=1.3,
    gloss=0.7,
    speckle=0.0,
    cells=0.0,
    stretch=1.0,
)
PULMONARY = TissueStyle(
    family="pulmonary",
    base=(0.78, 0.62, 0.74),
    dark=(0.50, 0.46, 0.56),
    patch=(0.58, 0.60, 0.72),
    vessel=(0.40, 0.28, 0.42),
    patch_share=0.25,
    vessels=2,
    roughness=0.5,
    folds=0.5,
    gloss=0.5,
    speckle=0.05,
    cells=0.9,
    stretch=1.0,
)
CARTOON = TissueStyle(
    family="cartoon",
    base=(0.95, 0.45, 0.20),
    dark=(0.78, 0.18, 0.10),
    patch=(1.00, 0.85, 0.30),
    vessel=(0.55, 0.05, 0.35),
    patch_share=0.25,
    vessels=3,
    roughness=0.0,
    folds=0.8,
    gloss=0.0,
    speckle=0.0,
    cells=0.0,
    stretch=1.0,
)


@dataclass(frozen=True)
class ClutterStyle:
    """Generator version 2: what every real site has besides its tissue family (issue 15).

    Version 1 tissue was always strongly coloured, so "grey or pale" alone meant "instrument" and a
    pale site (E's lung) was read as metal. Real videos hold pale fascia, dark cautery marks and
    patients whose tissue is paler or darker; these break that shortcut without copying E."""

    saturation: tuple[float, float] = (0.45, 1.0)
    """Per-video factor on the tissue's saturation (1: the family's palette; 0: grey)."""
    brightness: tuple[float, float] = (0.85, 1.1)
    """Per-video factor on the tissue's albedo."""
    fascia_share: float = 0.14
    """Approximate fraction of the canvas under thin, pale, semi-transparent fascia sheets."""
    fascia: RGB = (0.82, 0.82, 0.86)
    """Colour of the fascia (grey-white, slightly cool: close to the instruments' metal)."""
    char_share: float = 0.012
    """Approximate fraction of the canvas with dark cautery marks (eschar)."""
    char: RGB = (0.13, 0.10, 0.10)
    """Colour of the cautery marks (near-black, like the shafts)."""


CLUTTER = ClutterStyle()
"""The clutter of generator version 2, the same for every non-cartoon site."""


SITES: dict[str, SiteStyle] = {
    "A": SiteStyle(
        name="A",
        surgery_type="nephrectomy",
        description="porcine nephrectomy, warm light, older robot (EndoVis2017 stand-in)",
        tissue=RENAL,
        camera=CameraStyle(
            tint=(1.03, 0.99, 0.95),
            vignette=0.55,
            noise=2.0,
            blur=0.6,
        ),
    ),
    "B": SiteStyle(
        name="B",
        surgery_type="nephrectomy",
        description="porcine nephrectomy, cool bright light, strong fall-off "
        "(EndoVis2018 stand-in)",
        tissue=RENAL,
        camera=CameraStyle(
            tint=(0.98, 1.0, 1.03),
            gain=1.04,
            gamma=0.95,
            vignette=0.65,
            light_offset=(0.08, -0.05),
            noise=3.0,
        ),
        metal_tint=(0.99, 1.0, 1.01),
    ),
    "C": SiteStyle(
        name="C",
        surgery_type="prostatectomy",
        description="robot-assisted prostatectomy, fibrous pale tissue, sparse labels "
        "(SAR-RARP50 stand-in)",
        tissue=PELVIC,
        camera=CameraStyle(
            tint=(1.0, 0.98, 0.97),
            vignette=0.45,
            light_offset=(-0.05, 0.05),
            noise=2.0,
            blur=0.4,
        ),
        metal_tint=(1.02, 1.0, 0.98),
    ),
    "D": SiteStyle(
        name="D",
        surgery_type="hysterectomy",
        description="laparoscopic hysterectomy, smooth purplish tissue, circular field of view, "
        "limited data (Hyst-YT stand-in)",
        tissue=UTERINE,
        camera=CameraStyle(
            tint=(1.01, 0.98, 1.01),
            vignette=0.4,
            noise=4.0,
            blur=0.5,
            fov_radius=0.43,
        ),
        metal_tint=(1.0, 0.99, 1.02),
    ),
    "E": SiteStyle(
        name="E",
        surgery_type="lobectomy",
        description="thoracoscopic lobectomy, lung surface with anthracotic dots, unseen "
        "background family, test only (Lob-YT stand-in)",
        tissue=PULMONARY,
        camera=CameraStyle(
            tint=(0.98, 1.0, 1.02),
            vignette=0.5,
            noise=3.0,
            blur=0.5,
        ),
        metal_tint=(0.99, 1.0, 1.01),
    ),
    "synthetic": SiteStyle(
        name="synthetic",
        surgery_type="synthetic",
        description="rendered virtual surgery: flat cartoon shading, saturated palette, "
        "independent frames (SISVSE stand-in, server only)",
        tissue=CARTOON,
        camera=CameraStyle(),
        cartoon=True,
        independent_frames=True,
    ),
    "grasp": SiteStyle(
        name="grasp",
        surgery_type="prostatectomy",
        description="robot-assisted prostatectomy from another hospital, binary labels, test only "
        "(GraSP stand-in)",
        tissue=PELVIC,
        camera=CameraStyle(
            tint=(1.03, 1.0, 0.95),
            gain=0.96,
            vignette=0.6,
            light_offset=(0.05, 0.0),
            noise=3.0,
            blur=0.6,
        ),
        metal_tint=(1.02, 1.0, 0.97),
        binary=True,
    ),
}


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitSize:
    """``videos`` videos of ``frames`` source frames each."""

    videos: int = 0
    frames: int = 0


@dataclass(frozen=True)
class SiteSize:
    """Videos per split of one site; masks on frames whose index is a multiple of label_every."""

    train: SplitSize = SplitSize()
    val: SplitSize = SplitSize()
    test: SplitSize = SplitSize()
    label_every: int = 1

    def split(self, name: str) -> SplitSize:
        return {"train": self.train, "val": self.val, "test": self.test}[name]


@dataclass(frozen=True)
class Preset:
    name: str
    height: int
    width: int
    sites: dict[str, SiteSize]
    description: str


def _sizes(
    fed: SplitSize,
    fed_val: SplitSize,
    fed_test: SplitSize,
    sparse: tuple[SplitSize, SplitSize, SplitSize],
    limited: tuple[SplitSize, SplitSize, SplitSize],
    test_only: SplitSize,
    images: int,
) -> dict[str, SiteSize]:
    return {
        "A": SiteSize(fed, fed_val, fed_test),
        "B": SiteSize(fed, fed_val, fed_test),
        "C": SiteSize(*sparse, label_every=2),
        "D": SiteSize(*limited),
        "E": SiteSize(test=test_only),
        "synthetic": SiteSize(train=SplitSize(images, 1)),
        "grasp": SiteSize(test=test_only),
    }


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        height=64,
        width=80,
        sites=_sizes(
            SplitSize(2, 6),
            SplitSize(1, 6),
            SplitSize(1, 6),
            (SplitSize(2, 6), SplitSize(1, 6), SplitSize(1, 6)),
            (SplitSize(1, 6), SplitSize(1, 6), SplitSize(1, 6)),
            SplitSize(2, 6),
            12,
        ),
        description="unit tests: every site, a handful of 64x80 frames",
    ),
    "demo": Preset(
        name="demo",
        height=128,
        width=160,
        sites=_sizes(
            SplitSize(4, 25),
            SplitSize(1, 25),
            SplitSize(2, 25),
            (SplitSize(4, 50), SplitSize(1, 50), SplitSize(2, 50)),
            (SplitSize(1, 25), SplitSize(1, 25), SplitSize(2, 25)),
            SplitSize(2, 25),
            200,
        ),
        description="laptop federated demo at 128x160 (minutes on 2 CPU cores)",
    ),
    "full": Preset(
        name="full",
        height=256,
        width=320,
        sites={
            "A": SiteSize(SplitSize(8, 225), SplitSize(1, 75), SplitSize(4, 150)),
            "B": SiteSize(SplitSize(15, 149), SplitSize(1, 75), SplitSize(4, 249)),
            "C": SiteSize(SplitSize(7, 578), SplitSize(1, 150), SplitSize(6, 380), label_every=2),
            "D": SiteSize(SplitSize(2, 499), SplitSize(1, 100), SplitSize(2, 491)),
            "E": SiteSize(test=SplitSize(1, 203)),
            "synthetic": SiteSize(train=SplitSize(3600, 1)),
            "grasp": SiteSize(test=SplitSize(5, 60)),
        },
        description="labelled-frame counts of the paper's Table I at 256x320 (GPU users)",
    ),
    "paper_scale": Preset(
        name="paper_scale",
        height=512,
        width=640,
        sites=_sizes(
            SplitSize(1, 24),
            SplitSize(1, 8),
            SplitSize(1, 16),
            (SplitSize(1, 48), SplitSize(1, 16), SplitSize(1, 32)),
            (SplitSize(1, 24), SplitSize(1, 8), SplitSize(1, 16)),
            SplitSize(1, 16),
            3600,
        ),
        description="bench/paper_scale.py: the paper's 512x640 input and SISVSE's 3600 "
        "synthetic images, a few frames per site",
    ),
}


def video_ids(site: str, preset: Preset) -> dict[str, list[str]]:
    """Video ids per split: ``video_000``... numbered train, then val, then test
    (``image_0000``... for a site of independent frames)."""
    style, size = SITES[site], preset.sites[site]
    prefix, digits = ("image", 4) if style.independent_frames else ("video", 3)
    ids: dict[str, list[str]] = {}
    counter = 0
    for split in SPLITS:
        count = size.split(split).videos
        ids[split] = [f"{prefix}_{i:0{digits}d}" for i in range(counter, counter + count)]
        counter += count
    return ids


# --------------------------------------------------------------------------------------------
# Randomness and noise
# --------------------------------------------------------------------------------------------


def _rng(seed: int, *keys: str) -> np.random.Generator:
    """A Generator determined by ``seed`` and string ``keys`` (SHA-256, not Python's hash)."""
    digest = hashlib.sha256("/".join([str(seed), *keys]).encode()).digest()
    return np.random.default_rng(np.frombuffer(digest, dtype=np.uint32))


def _value_noise(
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


def _smoothstep(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    t = np.clip((x - lo) / (hi - lo), 0.0, 1.0)
    return t * t * (3.0 - 2.0 * t)


def _mix(a: np.ndarray, colour: RGB, weight: np.ndarray) -> np.ndarray:
    """Blend image ``a`` [H, W, 3] towards ``colour`` by ``weight`` [H, W]."""
    w = weight[..., None]
    return a * (1.0 - w) + np.asarray(colour, np.float32) * w


class _Sinusoids:
    """A smooth scalar signal: sum of sinusoids with random frequencies (continuous velocity)."""

    def __init__(self, rng: np.random.Generator, amplitude: float, max_hz: float, terms: int = 3):
        self.freqs = rng.uniform(0.25, 1.0, terms) * max_hz * 2 * math.pi
        self.phases = rng.uniform(0, 2 * math.pi, terms)
        weights = rng.uniform(0.5, 1.0, terms)
        self.amps = amplitude * weights / weights.sum()

    def __call__(self, t: float) -> float:
        return float(np.sum(self.amps * np.sin(self.freqs * t + self.phases)))


# --------------------------------------------------------------------------------------------
# Tissue background
# --------------------------------------------------------------------------------------------


class _TissueScene:
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
        self.shift_x = _Sinusoids(rng, drift, 0.08)
        self.shift_y = _Sinusoids(rng, drift, 0.08)
        self.rotation = _Sinusoids(rng, 0.06 if moving else 0.0, 0.05)
        self.zoom = _Sinusoids(rng, 0.05 if moving else 0.0, 0.05)
        wobble = 0.02 * max(height, width) if moving else 0.0
        self.deform_fields = [
            cv2.GaussianBlur(_value_noise(rng, height, width, 3, 1), (0, 0), 2) for _ in range(4)
        ]
        self.deform = [_Sinusoids(rng, wobble, 0.3, terms=2) for _ in range(4)]
        yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
        self.xc, self.yc = xx - (width - 1) / 2, yy - (height - 1) / 2

    @staticmethod
    def _canvas(
        rng: np.random.Generator, tissue: TissueStyle, ch: int, cw: int, frame_h: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Albedo [ch, cw, 3] and relief [ch, cw, 2] (fold height, fine wet bumps) of the tissue."""
        scale = ch / frame_h
        broad = _value_noise(rng, ch, cw, 2.5 * scale, 3)
        mid = _value_noise(rng, ch, cw, 6 * scale, 3, stretch=1 / tissue.stretch)
        fine = _value_noise(rng, ch, cw, 24 * scale, 2, stretch=1 / tissue.stretch)
        albedo = np.empty((ch, cw, 3), np.float32)
        albedo[:] = tissue.base
        albedo = _mix(albedo, tissue.dark, 0.9 * _smoothstep(broad + 0.4 * mid, -0.4, 1.6))
        patch_field = _value_noise(rng, ch, cw, 3 * scale, 3) + 0.25 * fine
        threshold = float(np.quantile(patch_field, 1 - tissue.patch_share))
        patches = 0.8 * _smoothstep(patch_field, threshold - 0.35, threshold + 0.5)
        albedo = _mix(albedo, tissue.patch, patches)
        albedo *= (1.0 + 0.12 * tissue.roughness * (0.6 * mid + 0.6 * fine))[..., None]

        relief = tissue.folds * (1.3 * broad + 0.5 * mid) + 0.2 * tissue.roughness * fine
        relief += 0.25 * patches
        if tissue.cells > 0:
            network = np.abs(_value_noise(rng, ch, cw, 14 * scale, 1))
            lines = 1.0 - _smoothstep(network, 0.0, 0.18)
            albedo = _mix(albedo, tissue.dark, tissue.cells * 0.6 * lines)
            relief -= 0.3 * tissue.cells * lines
        if tissue.speckle > 0:
            dots = _value_noise(rng, ch, cw, 40 * scale, 1) + 0.8 * mid
            cutoff = float(np.quantile(dots, 1 - tissue.speckle))
            speckles = _smoothstep(dots, cutoff, cutoff + 0.3)
            albedo = _mix(albedo, (0.12, 0.11, 0.13), 0.85 * speckles)

        vessels = np.zeros((ch, cw), np.float32)
        for _ in range(tissue.vessels):
            _draw_vessel_tree(rng, vessels, frame_h)
        vessels = cv2.GaussianBlur(vessels, (0, 0), max(0.7, frame_h / 110))
        albedo = _mix(albedo, tissue.vessel, np.clip(vessels, 0, 1) * 0.6)
        relief += 0.3 * vessels
        # Fine wet bumps: only shape the specular highlights (see _shade).
        wet = _smoothstep(_value_noise(rng, ch, cw, 2 * scale, 2), 0.2, 1.6)
        bumps = _value_noise(rng, ch, cw, 9 * scale, 2) * wet
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

    sheet_field = _value_noise(rng, ch, cw, 2.5 * scale, 3, stretch=0.6)
    streaks = _value_noise(rng, ch, cw, 10 * scale, 2, stretch=0.35)
    cutoff = float(np.quantile(sheet_field, 1 - clutter.fascia_share))
    sheets = _smoothstep(sheet_field, cutoff - 0.2, cutoff + 0.4) * np.clip(
        0.75 + 0.2 * streaks, 0, 1
    )
    albedo = _mix(albedo, clutter.fascia, sheets)

    marks = _value_noise(rng, ch, cw, 18 * scale, 2) + 0.6 * _value_noise(rng, ch, cw, 4 * scale, 1)
    cutoff = float(np.quantile(marks, 1 - clutter.char_share))
    char = _smoothstep(marks, cutoff, cutoff + 0.25)
    albedo = _mix(albedo, clutter.char, 0.9 * char)

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


# --------------------------------------------------------------------------------------------
# Instruments
# --------------------------------------------------------------------------------------------

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
class _Part:
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


class _InstrumentTrack:
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
        self.dx, self.dy = _Sinusoids(rng, amp, 0.12), _Sinusoids(rng, amp, 0.12)
        self.jitter = rng.uniform(-0.25, 0.25, 2) * np.array([width, height]) * (not moving)
        self.wrist_rest = rng.uniform(-0.7, 0.7)
        self.wrist = _Sinusoids(rng, 0.5 if moving else 0.0, 0.2)
        self.jaw_pitch = _Sinusoids(rng, 0.4 if moving else 0.0, 0.25)
        self.open_phase = rng.uniform(0, 2 * math.pi)
        self.open_hz = rng.uniform(0.1, 0.3) if moving else 0.0
        self.open_static = rng.uniform(0, 1)

    def parts(self, t: float, tint: RGB) -> list[_Part]:
        """Shaft, wrist and jaw blades at time ``t`` (seconds), in draw order."""
        joint = self.rest + self.jitter + np.array([self.dx(t), self.dy(t)])
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
            _Part(
                label=SHAFT,
                polygon=_capsule(self.pivot, joint, w, False),
                origin=joint,
                axis=_unit(shaft_angle),
                half_width=w / 2,
                colour=_tinted(SHAFT_COLOUR, tint),
            ),
            _Part(
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
            parts.append(_Part(JAW, polygon, base, _unit(angle), bw / 2, _tinted(JAW_COLOUR, tint)))
        return parts


def _tinted(colour: RGB, tint: RGB) -> RGB:
    return (colour[0] * tint[0], colour[1] * tint[1], colour[2] * tint[2])


def _draw_part(image: np.ndarray, mask: np.ndarray, part: _Part, cartoon: bool) -> None:
    """Rasterise ``part`` into ``image`` [H, W, 3] (anti-aliased, shaded) and ``mask`` [H, W]."""
    height, width = mask.shape
    vertices = np.round(part.polygon * 16).astype(np.int32)  # 4 fractional bits (shift=4)
    cv2.fillPoly(mask, [vertices], int(part.label), cv2.LINE_8, shift=4)
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


def _draw_details(image: np.ndarray, parts: list[_Part]) -> None:
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


def _shadow(parts_per_tool: list[list[_Part]], height: int, width: int) -> np.ndarray:
    """Soft shadow [H, W] in 0..1 cast by the instruments onto the tissue."""
    layer = np.zeros((height, width), np.float32)
    offset = np.array([0.035 * width, 0.05 * height])
    for parts in parts_per_tool:
        for part in parts:
            vertices = np.round((part.polygon + offset) * 16).astype(np.int32)
            cv2.fillPoly(layer, [vertices], 1.0, cv2.LINE_AA, shift=4)
    return cv2.GaussianBlur(layer, (0, 0), 0.03 * height + 0.5)


# --------------------------------------------------------------------------------------------
# Camera and video
# --------------------------------------------------------------------------------------------


def _camera(
    image: np.ndarray, style: SiteStyle, rng: np.random.Generator, vignette: np.ndarray
) -> np.ndarray:
    """Apply the site camera to a composed frame [H, W, 3] float 0..1 -> uint8 RGB."""
    camera = style.camera
    image = image * vignette[..., None] * np.asarray(camera.tint, np.float32) * camera.gain
    image = np.clip(image, 0, 1) ** camera.gamma
    if camera.blur > 0:
        image = cv2.GaussianBlur(image, (0, 0), camera.blur * image.shape[0] / 128)
    image = image * 255.0
    if camera.noise > 0:
        image = image + rng.normal(0, camera.noise, image.shape).astype(np.float32)
    return np.clip(image + 0.5, 0, 255).astype(np.uint8)


def _vignette(style: SiteStyle, height: int, width: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Light fall-off [H, W] and the circular field-of-view mask [H, W] bool (or None)."""
    camera = style.camera
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    cx = (width - 1) / 2 + camera.light_offset[0] * width
    cy = (height - 1) / 2 + camera.light_offset[1] * height
    half_diag = math.hypot(width, height) / 2
    r = np.sqrt((xx - cx) ** 2 + (yy - cy) ** 2) / half_diag
    falloff = np.clip(1.0 - camera.vignette * r**2, 0.05, 1.0)
    if camera.fov_radius <= 0:
        return falloff, None
    rc = np.sqrt((xx - (width - 1) / 2) ** 2 + (yy - (height - 1) / 2) ** 2) / (2 * half_diag)
    inside = rc <= camera.fov_radius
    falloff = falloff * _smoothstep(camera.fov_radius - rc, 0.0, 0.02)
    return falloff, inside


def render_video(
    site: str,
    preset: str,
    seed: int,
    video_id: str,
    frames: int | None = None,
    version: int = GENERATOR_VERSION,
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Render one video: yields (frame_index, RGB uint8 [H, W, 3], mask uint8 [H, W]) per frame.

    ``frames`` overrides the preset's frame count. Deterministic in (seed, site, video_id, version)
    plus the preset's frame size. Masks hold the part labels 0..3 (0/1 for a binary site), in draw
    order. ``version``: one of :data:`GENERATOR_VERSIONS`.
    """
    _check_names(preset, [site])
    _check_version(version)
    style, spec = SITES[site], PRESETS[preset]
    height, width = spec.height, spec.width
    if frames is None:
        ids = video_ids(site, spec)
        splits = [split for split in SPLITS if video_id in ids[split]]
        if not splits:
            known = [v for split in SPLITS for v in ids[split]]
            raise DataError(
                f"video {video_id!r} is not part of site {site!r} in preset {preset!r}; pass "
                f"frames=N to render it anyway, or pick one of {known}"
            )
        frames = spec.sites[site].split(splits[0]).frames
    rng = _rng(seed, site, video_id)
    clutter_rng = _rng(seed, site, video_id, "clutter") if version >= 2 else None
    scene = _TissueScene(rng, style, height, width, clutter_rng)
    moving = not style.independent_frames
    n_tools = int(rng.choice([1, 2, 3], p=[0.3, 0.5, 0.2]))
    tools = [_InstrumentTrack(rng, height, width, moving) for _ in range(n_tools)]
    time_offset = rng.uniform(0, 60)  # start somewhere inside the motion pattern
    noise_rng = np.random.default_rng(rng.integers(2**63))
    vignette, field_of_view = _vignette(style, height, width)
    for index in range(frames):
        t = time_offset + index / FPS
        image = scene.render(t)
        parts_per_tool = [tool.parts(t, style.metal_tint) for tool in tools]
        shadow = _shadow(parts_per_tool, height, width)
        image = image * (1.0 - 0.45 * shadow)[..., None]
        mask = np.zeros((height, width), np.uint8)
        for parts in parts_per_tool:
            for part in parts:
                _draw_part(image, mask, part, style.cartoon)
            if not style.cartoon:
                _draw_details(image, parts)
        frame = _camera(image, style, noise_rng, vignette)
        if field_of_view is not None:
            mask[~field_of_view] = 0
        if style.binary:
            mask = (mask > 0).astype(np.uint8)
        yield index, frame, mask


# --------------------------------------------------------------------------------------------
# Writing sites
# --------------------------------------------------------------------------------------------


def _check_version(version: int) -> None:
    if version not in GENERATOR_VERSIONS:
        raise DataError(
            f"unknown generator version {version!r}; choose one of {sorted(GENERATOR_VERSIONS)} "
            "(data.generator_version / --version)"
        )


def _check_names(preset: str, sites: Sequence[str]) -> None:
    if preset not in PRESETS:
        raise DataError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    unknown = [s for s in sites if s not in SITES]
    if unknown:
        raise DataError(f"unknown site(s) {unknown}; choose from {list(SITES)}")


def _write_png(path: Path, array: np.ndarray) -> None:
    if array.ndim == 3:
        array = cv2.cvtColor(array, cv2.COLOR_RGB2BGR)
    if not cv2.imwrite(str(path), array, list(PNG_PARAMS)):
        raise DataError(f"{path}: cv2.imwrite failed; check that the folder is writable")


def _write_video(task: tuple[Path, str, str, int, str, int, int, int]) -> None:
    """Worker: render one video and write its frames and its masks (every label_every-th)."""
    site_dir, site, preset, seed, video_id, frames, label_every, version = task
    cv2.setNumThreads(1)
    frames_dir = site_dir / "videos" / video_id / "frames"
    masks_dir = site_dir / "videos" / video_id / "masks"
    frames_dir.mkdir(parents=True, exist_ok=True)
    masks_dir.mkdir(parents=True, exist_ok=True)
    for index, frame, mask in render_video(site, preset, seed, video_id, frames, version):
        _write_png(frames_dir / f"{index:09d}.png", frame)
        if index % label_every == 0:
            _write_png(masks_dir / f"{index:09d}.png", mask)


def _meta(site: str, preset: Preset, seed: int, version: int) -> dict:
    style, size = SITES[site], preset.sites[site]
    return {
        "fps": FPS,
        "annotated_fps": FPS / size.label_every,
        "classes": list(BINARY_CLASSES if style.binary else CLASS_NAMES),
        "ignore_index": IGNORE_INDEX,
        "surgery_type": style.surgery_type,
        "binary": style.binary,
        "generator": {"seed": seed, "preset": preset.name, "version": version},
    }


LOCK_FILE = ".generating.lock"
INCOMPLETE_MARKER = ".generating"
"""Written into a site folder before its first file and removed after its meta.json: a folder that
holds it is an interrupted generation, the only folder without meta.json the generator rewrites."""


def _needs_generation(site_dir: Path, meta: dict, force: bool) -> bool:
    """Whether to (re)write ``site_dir``; never touches a folder the generator did not write.

    Absent or empty folder, or an interrupted generation (:data:`INCOMPLETE_MARKER`): yes. A
    complete site with the same (seed, preset, version) and meta: no. A generated site that
    differs: a DataError naming the difference, unless ``force`` (regenerate on purpose). A folder
    with other content (no meta.json, or a meta.json without the generator's key): a DataError.
    """
    path = site_dir / "meta.json"
    if not site_dir.exists() or (site_dir / INCOMPLETE_MARKER).exists():
        return True
    if not path.is_file():
        if not any(site_dir.iterdir()):
            return True
        raise DataError(
            f"{site_dir}: folder exists without meta.json and was not left by an interrupted "
            "generation; refusing to write into it: move it away or choose another root / --out"
        )
    try:
        existing = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        existing = {}
    if not isinstance(existing, dict) or "generator" not in existing:
        raise DataError(
            f"{path}: this site folder was not written by the procedural generator "
            f"(no 'generator' key); refusing to overwrite it: choose another --out"
        )
    if force:
        logger.warning(
            "site %s: regenerating on request (%s)",
            site_dir,
            _differences(existing, meta) or "same settings",
        )
        return True
    if existing == meta:
        return False
    raise DataError(
        f"{site_dir} holds a generated site that differs from the one asked for: "
        f"{_differences(existing, meta)}. Nothing was changed. Point data.root / --out at another "
        "folder, or regenerate on purpose (this deletes its videos/ and splits/) with "
        "regenerate=true (train_fed.py) or --force (python -m fedst.data.procedural)"
    )


def _differences(existing: dict, wanted: dict) -> str:
    """``key: found X, wanted Y`` for every differing meta.json key (generator keys flattened)."""

    def flat(meta: dict) -> dict:
        out = {k: v for k, v in meta.items() if k != "generator"}
        generator = meta.get("generator")
        if isinstance(generator, dict):
            out.update({f"generator.{k}": v for k, v in generator.items()})
        return out

    found, asked = flat(existing), flat(wanted)
    keys = sorted(set(found) | set(asked))
    return "; ".join(
        f"{k}: found {found.get(k)!r}, wanted {asked.get(k)!r}"
        for k in keys
        if found.get(k) != asked.get(k)
    )


def _count(site_dir: Path) -> dict:
    """Videos, frames and labelled frames per split, counted on disk."""
    counts: dict = {"videos": {}, "labelled": {}, "frames": 0}
    for split in SPLITS:
        ids = [v for v in (site_dir / "splits" / f"{split}.txt").read_text().split() if v]
        counts["videos"][split] = len(ids)
        counts["labelled"][split] = sum(
            len(list((site_dir / "videos" / v / "masks").glob("*.png"))) for v in ids
        )
        counts["frames"] += sum(
            len(list((site_dir / "videos" / v / "frames").glob("*.png"))) for v in ids
        )
    return counts


def _start_site(site_dir: Path) -> None:
    """Mark ``site_dir`` as being generated (:data:`INCOMPLETE_MARKER`), then clear what an earlier
    generation left: meta.json, videos/ and splits/."""
    site_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / INCOMPLETE_MARKER).touch()
    (site_dir / "meta.json").unlink(missing_ok=True)
    for sub in ("videos", "splits"):
        shutil.rmtree(site_dir / sub, ignore_errors=True)


def _finish_site(site_dir: Path, ids: dict[str, list[str]], meta: dict) -> None:
    """After its videos: the split files, meta.json (atomically, last) and the marker removed."""
    (site_dir / "splits").mkdir(parents=True, exist_ok=True)
    for split, split_ids in ids.items():
        (site_dir / "splits" / f"{split}.txt").write_text("".join(f"{v}\n" for v in split_ids))
    tmp = site_dir / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, site_dir / "meta.json")
    (site_dir / INCOMPLETE_MARKER).unlink()


@contextlib.contextmanager
def _generation_lock(out: Path) -> Iterator[None]:
    """Hold ``<out>/.generating.lock`` (an exclusive advisory lock) while a call decides what to
    write and writes it: two runs started at once on one absent benchmark (``--jobs 2``) then
    generate it once instead of both writing the same PNGs. No-op where ``fcntl`` is missing."""
    out.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    with open(out / LOCK_FILE, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_videos(
    tasks: list[tuple], desc: str, workers: int, progress: bool, chunksize: int
) -> None:
    """Render every video task (_write_video), in ``workers`` spawned processes when > 1."""
    bar = progress_bar(total=len(tasks), desc=desc, unit="video", enabled=progress)
    if workers > 1 and len(tasks) > 1:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            for _ in pool.imap_unordered(_write_video, tasks, chunksize=chunksize):
                bar.update()
    else:
        for task in tasks:
            _write_video(task)
            bar.update()
    bar.close()


def generate(
    out: Path,
    seed: int,
    preset: str,
    sites: Sequence[str] | None = None,
    *,
    force: bool = False,
    workers: int = 2,
    progress: bool = True,
    version: int = GENERATOR_VERSION,
) -> dict[str, dict]:
    """Write ``sites`` (default: all of :data:`SITES`) of ``preset`` under ``out``, rendered by
    generator ``version`` (:data:`GENERATOR_VERSIONS`).

    Only absent sites and interrupted generations are written. A site whose meta.json matches
    (seed, preset, version) is skipped; one that differs is a DataError naming the difference
    unless ``force`` (which regenerates every named site, deleting its videos/ and splits/); a
    folder the generator did not write is never touched. Returns per site: ``videos`` and ``labelled``
    frame counts per split, total ``frames`` and whether it was ``generated`` in this call.
    """
    names = list(SITES) if sites is None else list(sites)
    _check_names(preset, names)
    _check_version(version)
    spec = PRESETS[preset]
    out = Path(out)
    with _generation_lock(out):
        tasks, todo = [], []
        for site in names:
            site_dir = out / site
            if not _needs_generation(site_dir, _meta(site, spec, seed, version), force):
                logger.info("site %s: up to date in %s, skipped", site, site_dir)
                continue
            _start_site(site_dir)
            todo.append(site)
            size = spec.sites[site]
            for split, ids in video_ids(site, spec).items():
                frames = size.split(split).frames
                tasks.extend(
                    (site_dir, site, preset, seed, v, frames, size.label_every, version)
                    for v in ids
                )
        _write_videos(tasks, f"procedural {preset}", workers, progress, chunksize=4)
        for site in todo:
            _finish_site(out / site, video_ids(site, spec), _meta(site, spec, seed, version))
    result = {}
    for site in names:
        result[site] = _count(out / site) | {"generated": site in todo}
    return result


ORACLE_SUFFIX = "_oracle"
ORACLE_VIDEO_PREFIX = "oracle"
ORACLE_SIZE_OF = "A"
"""The oracle split has the train / val / test sizes of this federated site of the preset."""


def oracle_site_name(site: str) -> str:
    """Folder and site name of the diagnosis-only training split of ``site`` (E -> E_oracle)."""
    return f"{site}{ORACLE_SUFFIX}"


def oracle_video_ids(preset: Preset) -> dict[str, list[str]]:
    """``oracle_000``... numbered train, then val, then test (never an id of the benchmark)."""
    size, ids, counter = preset.sites[ORACLE_SIZE_OF], {}, 0
    for split in SPLITS:
        count = size.split(split).videos
        ids[split] = [f"{ORACLE_VIDEO_PREFIX}_{i:03d}" for i in range(counter, counter + count)]
        counter += count
    return ids


def _oracle_meta(site: str, preset: Preset, seed: int, version: int) -> dict:
    meta = _meta(site, preset, seed, version)
    meta["generator"] |= {"oracle_of": site}
    meta["diagnosis_only"] = True
    return meta


def generate_oracle_split(
    out: Path,
    seed: int,
    preset: str,
    site: str = "E",
    *,
    force: bool = False,
    workers: int = 2,
    progress: bool = True,
    version: int = GENERATOR_VERSION,
) -> dict:
    """Write ``<out>/<site>_oracle``: ``site``-style videos in the split sizes of site A of
    ``preset``, for diagnosis only (an oracle trained on the site's domain). Refused when ``out``
    holds a benchmark site (it must never become part of a federation's data folder). Returns the
    counts of :func:`generate`."""
    _check_names(preset, [site])
    _check_version(version)
    spec = PRESETS[preset]
    out = Path(out)
    if not spec.sites[site].test.videos or spec.sites[site].train.videos:
        raise DataError(
            f"--oracle-split {site}: only a test-only site (out of federation) has no training "
            f"videos to add; choose one of {[s for s in SITES if not spec.sites[s].train.videos]}"
        )
    benchmark = sorted(name for name in SITES if (out / name / "meta.json").is_file())
    if benchmark:
        raise DataError(
            f"{out} holds benchmark site(s) {benchmark}: write the diagnosis-only split into its "
            f"own folder (e.g. {out.parent / (out.name + '_oracle')}), never a benchmark root, so "
            "no federation reads it"
        )
    with _generation_lock(out):
        name = oracle_site_name(site)
        site_dir, meta = out / name, _oracle_meta(site, spec, seed, version)
        generated = _needs_generation(site_dir, meta, force)
        if generated:
            _start_site(site_dir)
            size = spec.sites[ORACLE_SIZE_OF]
            tasks = [
                (site_dir, site, preset, seed, v, size.split(split).frames, 1, version)
                for split, ids in oracle_video_ids(spec).items()
                for v in ids
            ]
            _write_videos(tasks, f"oracle {name}", workers, progress, chunksize=1)
            _finish_site(site_dir, oracle_video_ids(spec), meta)
        else:
            logger.info("oracle split %s: up to date in %s, skipped", name, site_dir)
    return {name: _count(site_dir) | {"generated": generated}}


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: ``python -m fedst.data.procedural --out DIR --seed N --preset demo``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="root folder of the sites")
    parser.add_argument("--seed", type=int, default=0, help="benchmark seed")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="demo", help="size preset")
    parser.add_argument("--sites", default=None, help=f"comma-separated subset of {list(SITES)}")
    parser.add_argument(
        "--force",
        action="store_true",
        help="regenerate existing generated sites (deletes their videos/ and splits/)",
    )
    parser.add_argument("--workers", type=int, default=2, help="processes rendering videos")
    parser.add_argument(
        "--version",
        type=int,
        choices=sorted(GENERATOR_VERSIONS),
        default=GENERATOR_VERSION,
        help="generator version (rendering); older ones stay reproducible",
    )
    parser.add_argument(
        "--oracle-split",
        metavar="SITE",
        default=None,
        help="instead of the benchmark: write <out>/<SITE>_oracle, training videos in a test-only "
        "site's style for diagnosis only (never into a benchmark folder)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.oracle_split is not None:
        if args.sites:
            parser.error("--oracle-split writes one site: drop --sites")
        counts = generate_oracle_split(
            args.out,
            args.seed,
            args.preset,
            args.oracle_split,
            force=args.force,
            workers=args.workers,
            version=args.version,
        )
    else:
        sites = args.sites.split(",") if args.sites else None
        counts = generate(
            args.out,
            args.seed,
            args.preset,
            sites,
            force=args.force,
            workers=args.workers,
            version=args.version,
        )
    for site, c in counts.items():
        state = "generated" if c["generated"] else "up to date"
        print(
            f"{site:>9}: {state:10} videos {c['videos']} labelled {c['labelled']} "
            f"frames {c['frames']}"
        )


if __name__ == "__main__":
    main()

"""What the procedural benchmark is made of, before anything is drawn: the generator versions
(:data:`GENERATOR_VERSIONS`, their changelog is the package docstring), the frame rate, every
site's look (tissue family, camera, metal tint: :data:`SITES`), the clutter of version 2
(:data:`CLUTTER`), the temporal phenomena of versions 3-4 (:data:`PHENOMENA`), the size presets (:data:`PRESETS`) with the video ids they number, and the
checks of a preset, site or version name asked for."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fedst.data.base import SPLITS, DataError
from fedst.schema.data import GENERATOR_VERSIONS

FPS = 5

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


@dataclass(frozen=True)
class PhenomenaStyle:
    """Generator version 3: what hides the instruments in one frame and not in the next (issue 47).

    Rates are per second of video and per instrument unless said otherwise; where each number
    comes from (a publication, or a stated assumption) is in docs/benchmark.md, "Generator
    version 3". Every phenomenon degrades the image only, except the tissue occlusion, which
    also removes the hidden instrument pixels from the mask."""

    field_of_view_deg: float = 70.0
    """Diagonal angle of view of the laparoscope (typical wide-angle laparoscope lens)."""
    working_distance_cm: float = 7.0
    """Distance from the lens to the instruments (assumption: 5-10 cm in laparoscopy)."""
    tip_speed_cm_s: float = 2.4
    """Median in-image speed of an instrument while it moves: 3 cm/s of 3-D tip speed (da Vinci
    kinematics) times pi / 4, the mean projection of a random direction onto the image plane."""
    tip_speed_spread: float = 0.5
    """Log-normal sigma of an instrument's speed around the median (assumption)."""
    exposure_s: float = 1 / 25
    """Exposure of one frame (assumption: auto-exposure in a dim abdomen); motion blur spans
    speed x exposure."""
    smoke_per_s: float = 0.15
    """Cautery smoke puffs per second of video (assumption: no published rate found)."""
    smoke_duration_s: tuple[float, float] = (1.5, 4.0)
    """How long one puff veils the scene, drawn uniformly (evacuation clears it in seconds)."""
    smoke_density: tuple[float, float] = (0.6, 0.9)
    """Peak opacity of a puff's core."""
    smoke_radius: tuple[float, float] = (0.25, 0.45)
    """Radius of a grown puff, as a fraction of the frame's short side."""
    flash_per_s: float = 0.25
    """Specular flashes per second per instrument, one frame each (assumption)."""
    occlusion_per_s: float = 0.1
    """Tissue folds passing over an instrument per second per instrument (assumption)."""
    occlusion_duration_s: tuple[float, float] = (0.6, 1.6)
    """How long an instrument part stays under the fold, drawn uniformly."""
    occlusion_radius: tuple[float, float] = (0.12, 0.2)
    """Radius of the fold, as a fraction of the frame's short side."""

    def pixels_per_cm(self, height: int, width: int) -> float:
        """Image pixels per cm at the working distance for a frame of ``height`` x ``width``."""
        diagonal_cm = (
            2 * self.working_distance_cm * math.tan(math.radians(self.field_of_view_deg / 2))
        )
        return math.hypot(height, width) / diagonal_cm


PHENOMENA = PhenomenaStyle()
"""The temporal phenomena of generator version 3, the same for every video site."""


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


OUTFED_TEST = SplitSize(24, 15)
"""The out-of-federation test split of preset demo_outfed (generator version 3's data=demo_v3):
24 videos, so that with a per-video Dice spread of about 12 points the standard error of E's score
from test sampling is about 12 / sqrt(24) = 2.45 points (docs/benchmark.md)."""
OUTFED_TEST_30 = SplitSize(30, 15)
"""The out-of-federation test split of preset demo_outfed30 (generator version 4's data=demo_v4):
30 videos, so that with version 3's measured per-video Dice spread of 13.5 points the standard
error of E's score from test sampling is 13.5 / sqrt(30) = 2.46 points (docs/benchmark.md)."""

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
    "gpu_check": Preset(
        name="gpu_check",
        height=64,
        width=80,
        sites=_sizes(
            SplitSize(2, 6),
            SplitSize(1, 6),
            SplitSize(2, 24),
            (SplitSize(2, 6), SplitSize(1, 6), SplitSize(2, 48)),
            (SplitSize(1, 6), SplitSize(1, 6), SplitSize(2, 24)),
            SplitSize(2, 6),
            24,
        ),
        description="bench/gpu_check/gpu_check.sh: tiny's training splits with 48 test frames per "
        "federated site (C: 48 labelled of 96), so an evaluation's loader start is amortised",
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


def _demo_outfed(name: str, test: SplitSize, description: str) -> Preset:
    """The demo with larger out-of-federation test splits ``test`` for E and grasp."""
    sites = {**PRESETS["demo"].sites, "E": SiteSize(test=test), "grasp": SiteSize(test=test)}
    return Preset(name=name, height=128, width=160, sites=sites, description=description)


PRESETS["demo_outfed"] = _demo_outfed(
    "demo_outfed",
    OUTFED_TEST,
    "demo with out-of-federation test splits of 24 videos x 15 frames (E, grasp): "
    "test sampling's standard error on E about 2.5 Dice points (docs/benchmark.md)",
)
PRESETS["demo_outfed30"] = _demo_outfed(
    "demo_outfed30",
    OUTFED_TEST_30,
    "demo with out-of-federation test splits of 30 videos x 15 frames (E, grasp): "
    "test sampling's standard error on E 2.46 Dice points at version 3's measured spread "
    "(docs/benchmark.md, generator version 4)",
)


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


def check_version(version: int) -> None:
    if version not in GENERATOR_VERSIONS:
        raise DataError(
            f"unknown generator version {version!r}; choose one of {sorted(GENERATOR_VERSIONS)} "
            "(data.generator_version / --version)"
        )


def check_names(preset: str, sites: Sequence[str]) -> None:
    if preset not in PRESETS:
        raise DataError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    unknown = [s for s in sites if s not in SITES]
    if unknown:
        raise DataError(f"unknown site(s) {unknown}; choose from {list(SITES)}")

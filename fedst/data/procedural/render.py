"""One video, in memory: :func:`render_video` composes the tissue scene, the instruments' shadow and
parts, from version 3 the temporal phenomena (fedst/data/procedural/phenomena.py), then the site's camera (vignetting and light spot, tint, gain, gamma, blur, sensor noise,
circular field of view), frame by frame, from random streams seeded by (seed, site, video id) and
the generator version. Nothing is written to disk here (fedst/data/procedural/writer.py does)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import cv2
import numpy as np

from fedst.data.base import SPLITS, DataError
from fedst.data.procedural.instruments import (
    InstrumentTrack,
    draw_details,
    draw_part,
    fill_footprint,
    instrument_shadow,
)
from fedst.data.procedural.noise import seeded_rng, smoothstep
from fedst.data.procedural.phenomena import SMOKE_COLOUR, FrameTruth, VideoPhenomena
from fedst.data.procedural.scene import TissueScene
from fedst.data.procedural.sites import (
    FPS,
    PHENOMENA,
    PRESETS,
    SITES,
    PhenomenaStyle,
    SiteStyle,
    check_names,
    check_version,
    video_ids,
)
from fedst.schema.data import GENERATOR_VERSION


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
    falloff = falloff * smoothstep(camera.fov_radius - rc, 0.0, 0.02)
    return falloff, inside


def render_video(*args: object, **kwargs: object) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Render one video: yields (frame_index, RGB uint8 [H, W, 3], mask uint8 [H, W]) per frame.

    Arguments: (site, preset, seed, video_id, frames=None, version=GENERATOR_VERSION), those of
    :func:`render_video_truth`. ``frames`` overrides the preset's frame count. Deterministic in
    (seed, site, video_id, version) plus the preset's frame size. Masks hold the part labels 0..3
    (0/1 for a binary site), in draw order. ``version``: one of :data:`GENERATOR_VERSIONS`.
    """
    for index, frame, mask, _ in render_video_truth(*args, **kwargs):  # type: ignore[arg-type]
        yield index, frame, mask


def render_video_truth(
    site: str,
    preset: str,
    seed: int,
    video_id: str,
    frames: int | None = None,
    version: int = GENERATOR_VERSION,
    phenomena: PhenomenaStyle = PHENOMENA,
) -> Iterator[tuple[int, np.ndarray, np.ndarray, FrameTruth | None]]:
    """:func:`render_video` plus, from version 3 on, each frame's :class:`FrameTruth` (what smoke,
    flashes, motion blur and tissue folds did to it; ``None`` before version 3 and for a site of
    independent frames). Version 4 renders version 3's images and masks; its truth adds the
    change motion blur made to each pixel. ``phenomena`` replaces the rates (tests switch one
    off)."""
    check_names(preset, [site])
    check_version(version)
    style, spec = SITES[site], PRESETS[preset]
    height, width = spec.height, spec.width
    if frames is None:
        frames = _preset_frames(site, preset, video_id)
    rng = seeded_rng(seed, site, video_id)
    clutter_rng = seeded_rng(seed, site, video_id, "clutter") if version >= 2 else None
    scene = TissueScene(rng, style, height, width, clutter_rng)
    moving = not style.independent_frames
    n_tools = int(rng.choice([1, 2, 3], p=[0.3, 0.5, 0.2]))
    tools = [InstrumentTrack(rng, height, width, moving) for _ in range(n_tools)]
    time_offset = rng.uniform(0, 60)  # start somewhere inside the motion pattern
    noise_rng = np.random.default_rng(rng.integers(2**63))
    vignette, field_of_view = _vignette(style, height, width)
    events = None
    if version >= 3 and moving:
        events = VideoPhenomena(
            phenomena, seed, site, video_id, tools, height, width, time_offset, frames
        )
    for index in range(frames):
        t = time_offset + index / FPS
        tissue = scene.render(t)
        parts_per_tool = [tool.parts(t, style.metal_tint) for tool in tools]
        image, mask = _instruments(tissue, parts_per_tool, style)
        truth = None
        if events is not None:
            image, truth = _phenomena(
                events, t, tissue, image, mask, parts_per_tool, tools, style, version
            )
        frame = _camera(image, style, noise_rng, vignette)
        if field_of_view is not None:
            mask[~field_of_view] = 0
            if truth is not None:
                truth.tool_ids[~field_of_view] = 0
        if style.binary:
            mask = (mask > 0).astype(np.uint8)
        yield index, frame, mask, truth


def _preset_frames(site: str, preset: str, video_id: str) -> int:
    """The preset's frame count of ``video_id``; an error naming the known ids if it has none."""
    spec = PRESETS[preset]
    ids = video_ids(site, spec)
    splits = [split for split in SPLITS if video_id in ids[split]]
    if not splits:
        known = [v for split in SPLITS for v in ids[split]]
        raise DataError(
            f"video {video_id!r} is not part of site {site!r} in preset {preset!r}; pass "
            f"frames=N to render it anyway, or pick one of {known}"
        )
    return spec.sites[site].split(splits[0]).frames


def _instruments(
    tissue: np.ndarray, parts_per_tool: list[list], style: SiteStyle
) -> tuple[np.ndarray, np.ndarray]:
    """The instruments' shadow, parts and details over ``tissue`` [H, W, 3]: (image, mask)."""
    height, width = tissue.shape[:2]
    shadow = instrument_shadow(parts_per_tool, height, width)
    image = tissue * (1.0 - 0.45 * shadow)[..., None]
    mask = np.zeros((height, width), np.uint8)
    for parts in parts_per_tool:
        for part in parts:
            draw_part(image, mask, part, style.cartoon)
        if not style.cartoon:
            draw_details(image, parts)
    return image, mask


def _phenomena(
    events: VideoPhenomena,
    t: float,
    tissue: np.ndarray,
    image: np.ndarray,
    mask: np.ndarray,
    parts_per_tool: list[list],
    tools: list[InstrumentTrack],
    style: SiteStyle,
    version: int,
) -> tuple[np.ndarray, FrameTruth]:
    """Versions 3-4 on a composed frame: motion blur (the instruments averaged over the exposure),
    tissue folds (image and mask), specular flashes and smoke (image only). ``mask`` is changed
    in place (folds); returns the image and the frame's truth (from version 4 with the change
    the blur made to each pixel)."""
    blur_px = events.blur_lengths(t)
    times = events.exposure_times(t, blur_px)
    sharp = image
    if len(times) > 1:
        image = np.mean(
            [
                _instruments(tissue, [tool.parts(s, style.metal_tint) for tool in tools], style)[0]
                for s in times
            ],
            axis=0,
        )
    blur_change = np.abs(image - sharp).mean(-1, dtype=np.float32) if version >= 4 else None
    tool_ids = np.zeros(mask.shape, np.uint8)
    for index, parts in enumerate(parts_per_tool, start=1):
        for part in parts:
            fill_footprint(tool_ids, part, index)
    coverage = events.fold_coverage(t, parts_per_tool)
    occluded = (coverage >= 0.5) & (mask > 0)
    occluded_px = tuple(int((occluded & (tool_ids == i)).sum()) for i in range(1, len(tools) + 1))
    fold_shade = (0.78 + 0.22 * smoothstep(coverage, 0.0, 1.0))[..., None]
    image = image * (1 - coverage[..., None]) + tissue * fold_shade * coverage[..., None]
    mask[coverage >= 0.5] = 0
    tool_ids[mask == 0] = 0
    flash = events.flash_light(parts_per_tool)
    image = image + flash[..., None]
    smoke = events.smoke_opacity(t)
    image = image * (1 - smoke[..., None]) + SMOKE_COLOUR * smoke[..., None]
    truth = FrameTruth(tool_ids, smoke, flash, occluded, tuple(blur_px), occluded_px, blur_change)
    return image.astype(np.float32), truth

"""Procedural multi-site surgical video benchmark, written in the generic layout (DESIGN.md sec. 5).

No surgical dataset can be downloaded here, so this package renders a deterministic stand-in for the
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
* demo_outfed, 128 x 160: demo with E and grasp test splits of 24 videos x 15 frames (360 frames
  each), so test sampling's standard error on E stays near 2.5 Dice points (``data=demo_v3``).
* demo_outfed30, 128 x 160: demo with E and grasp test splits of 30 videos x 15 frames (450
  frames each), standard error 13.5 / sqrt(30) = 2.46 at version 3's measured spread
  (``data=demo_v4``).
* full, 256 x 320, labelled train / test frames as in the paper's Table I: A 8x225 / 1x75 / 4x150
  (1800 / 600), B 15x149 / 1x75 / 4x249 (2235 / 996), C 7x578 / 1x150 / 6x380 [2023 / 1140],
  D 2x499 / 1x100 / 2x491 (998 / 982), E 1x203, grasp 5x60, synthetic 3600. Val videos are extra.
* paper_scale, 512 x 640: A, B, D 1x24 / 1x8 / 1x16; C 1x48 / 1x16 / 1x32 [half labelled];
  E, grasp 1x16; synthetic 3600 (SISVSE's count). The time and memory of a paper-size round
  (bench/paper_scale.py), not a benchmark to score.

Generation time, measured with ``python -m bench.data_generation`` (2 worker processes, on the
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
* 3 (issue 47; ``data=demo_v3``, not the default): version 2 plus :data:`PHENOMENA` in every
  video site (``phenomena``): instruments moving at published tool-tip speeds seen through a 70°
  laparoscope (about 10 px per frame at 128 x 160 against version 2's 1), motion blur over the
  exposure, cautery smoke lasting seconds, one-frame specular flashes and tissue folds that hide
  part of an instrument (those pixels are background in the mask; under smoke, flashes and blur
  the mask is unchanged). Each phenomenon draws from its own random stream, so version 2 renders
  bit for bit as before. :func:`render_video_truth` yields each frame's ground truth beside it
  (docs/benchmark.md, "Generator version 3", with the sources of every rate).
* 4 (issue 47; ``data=demo_v4``, not the default): version 3's images and masks, bit for bit;
  its ground truth adds, per pixel, the change motion blur made (``FrameTruth.blur_change``), and
  a pixel counts as degraded by blur only where that change is at least ``BLUR_CHANGES`` (version
  3: an instrument's whole footprint once it is blurred by 3 px). Used with preset
  ``demo_outfed30`` (30 test videos for E and grasp). Both changes answer version 3's failures
  against its criterion (docs/benchmark.md, "Generator version 4").

Bump :data:`GENERATOR_VERSION` (and add a line above) whenever the rendering changes; keep every
older version rendered bit for bit (tests/test_generator_versions.py). Existing sites are never
deleted silently: a site whose meta.json matches (seed, preset, version) is skipped, one that
differs stops generation with the difference named (``--force`` / ``regenerate=true`` regenerates
on purpose).

The package, bottom-up: ``sites`` (versions, site styles, presets, video ids), ``noise`` (random
streams, value noise, smooth signals), ``scene`` (tissue background), ``instruments`` (parts,
motion, drawing), ``phenomena`` (versions 3-4's smoke, flashes, blur, folds and speeds), ``render`` (one video in memory: :func:`render_video`), ``writer`` (sites on
disk: :func:`generate`, :func:`generate_oracle_split`) and ``cli`` (the command line of
``-m fedst.data.procedural``).

Layer: part of fedst.data; imports fedst.data and the root modules.
"""

from fedst.data.procedural.cli import main
from fedst.data.procedural.render import render_video, render_video_truth
from fedst.data.procedural.sites import (
    CLUTTER,
    FPS,
    PHENOMENA,
    PRESETS,
    SITES,
    ClutterStyle,
    PhenomenaStyle,
    Preset,
    SiteSize,
    SiteStyle,
    SplitSize,
    video_ids,
)
from fedst.data.procedural.writer import (
    LOCK_FILE,
    generate,
    generate_oracle_split,
    oracle_site_name,
)
from fedst.schema.data import GENERATOR_VERSION, GENERATOR_VERSIONS

__all__ = [
    "CLUTTER",
    "FPS",
    "GENERATOR_VERSION",
    "GENERATOR_VERSIONS",
    "LOCK_FILE",
    "PHENOMENA",
    "PRESETS",
    "SITES",
    "ClutterStyle",
    "PhenomenaStyle",
    "Preset",
    "SiteSize",
    "SiteStyle",
    "SplitSize",
    "generate",
    "generate_oracle_split",
    "main",
    "oracle_site_name",
    "render_video",
    "render_video_truth",
    "video_ids",
]

"""A site's data statistics before training, and the warnings they raise across a federation.

    python -m fedst.data.stats                       # data=demo: the benchmark `make demo` writes
    python -m fedst.data.stats data=tiny sample_frames=4
    python -m fedst.data.stats data=paper site=A

Per split (train, test, and val where the site has one): videos, frames and labelled frames;
over a sample of at most ``sample_frames`` labelled frames per split (evenly spaced, so the cost
stays small; every labelled frame when there are fewer): the pixel share of each class, of ignore
(255) and of label values outside the classes, the mean and standard deviation of the frames'
RGB values (0..255), and the frame and label sizes. Only these numbers leave a site: at the start
of a federated run each site answers one statistics message with them
(fedst/app/site_statistics.py) and the server writes ``site_stats.json`` into the run.

:func:`encoding_warnings` names a site whose labels look written in another encoding: label
values outside the classes (e.g. EndoVis2017's 10 / 20 / 30 read as classes 0..3), a part class
with no pixel in the site's sample while every other part-labelled site has it, or labels whose
size differs from their frames'.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import cv2
import numpy as np

from fedst.config import ConfigError, did_you_mean
from fedst.data._io import UnifiedLabelSource
from fedst.data.base import CLASS_NAMES, IGNORE_INDEX, SPLITS, DataError, LabelRef, SiteSource
from fedst.data.generic import GenericLayoutSource

__all__ = [
    "DEFAULT_SAMPLE_FRAMES",
    "encoding_warnings",
    "format_statistics",
    "site_statistics",
    "statistics_from_record",
    "statistics_to_record",
]

log = logging.getLogger(__name__)

DEFAULT_SAMPLE_FRAMES = 16
"""Labelled frames read per split: enough for class shares and colours, a few seconds a site."""
OPTIONAL_SPLITS = ("val",)
"""Splits a site may lack (its val split: model selection only); train and test are required."""
COUNT_FIELDS = ("videos", "frames", "labelled_frames", "sampled_frames")
SHARE_FIELDS = ("ignore_share", "outside_share")
COLOUR_FIELDS = ("colour_mean", "colour_std")
SIZE_FIELDS = ("frame_sizes", "label_sizes")


def _class_names(binary: bool) -> tuple[str, ...]:
    return ("background", "instrument") if binary else CLASS_NAMES


def site_statistics(
    source: SiteSource, sample_frames: int = DEFAULT_SAMPLE_FRAMES
) -> dict[str, Any]:
    """{"binary", "classes", "splits": {split: numbers}} of one site (module docstring).

    A split's numbers: :data:`COUNT_FIELDS` (ints), "class_share" (fraction per class of the
    sampled label pixels), :data:`SHARE_FIELDS` (fractions), "outside_values" (the values outside
    the classes), :data:`COLOUR_FIELDS` (RGB, 0..255) and :data:`SIZE_FIELDS` ({"HxW": frames}).
    """
    if sample_frames < 1:
        raise ValueError(f"sample_frames={sample_frames}: read at least 1 labelled frame a split")
    names = _class_names(source.binary)
    splits: dict[str, dict[str, Any]] = {}
    for split in SPLITS:
        try:
            videos = source.videos(split)
        except DataError:
            if split in OPTIONAL_SPLITS:
                continue  # no val split at this site: none reported
            raise
        labelled = [(v, p) for v in videos for p in sorted(v.labels)]
        picks = np.unique(np.linspace(0, len(labelled) - 1, min(sample_frames, len(labelled))))
        values = np.zeros(256, dtype=np.int64)
        unknown = 0  # pixels of unknown decoded values (set to 255 by the backend)
        colour_sum, colour_sq, pixels = np.zeros(3), np.zeros(3), 0
        frame_sizes: Counter = Counter()
        label_sizes: Counter = Counter()
        for index in picks.round().astype(int):
            video, position = labelled[index]
            rgb = source.read_frame(video.frames[position]).astype(np.float64)  # [H, W, 3]
            colour_sum += rgb.sum((0, 1))
            colour_sq += (rgb**2).sum((0, 1))
            pixels += rgb.shape[0] * rgb.shape[1]
            label, unknown_pixels = _raw_label(source, video.labels[position])  # [H, W]
            values += np.bincount(label.ravel(), minlength=256)
            unknown += unknown_pixels
            frame_sizes[f"{rgb.shape[0]}x{rgb.shape[1]}"] += 1
            label_sizes[f"{label.shape[0]}x{label.shape[1]}"] += 1
        total = max(int(values.sum()), 1)
        outside = [v for v in np.flatnonzero(values) if v >= len(names) and v != IGNORE_INDEX]
        mean = colour_sum / max(pixels, 1)
        splits[split] = {
            "videos": len(videos),
            "frames": sum(len(v.frames) for v in videos),
            "labelled_frames": len(labelled),
            "sampled_frames": len(picks),
            "class_share": [float(values[c] / total) for c in range(len(names))],
            "ignore_share": float((values[IGNORE_INDEX] - unknown) / total),
            "outside_share": float((values[outside].sum() + unknown) / total),
            "outside_values": [int(v) for v in outside],
            "colour_mean": mean.tolist(),
            "colour_std": np.sqrt(np.maximum(colour_sq / max(pixels, 1) - mean**2, 0)).tolist(),
            "frame_sizes": dict(frame_sizes),
            "label_sizes": dict(label_sizes),
        }
    return {"binary": source.binary, "classes": list(names), "splits": splits}


def _raw_label(source: SiteSource, ref: LabelRef) -> tuple[np.ndarray, int]:
    """(label map [H, W] uint8 with values outside the classes kept, not refused; pixels of
    unknown raw values a decoding backend set to 255). A generic-layout mask is read as stored;
    a decoded format (colours, other codes) reports its unknown values' pixels (their values are
    not grey levels, so they are counted in ``outside_share`` but not listed)."""
    if isinstance(source, GenericLayoutSource):
        raw = cv2.imread(str(ref.path), cv2.IMREAD_UNCHANGED)
        if raw is None or raw.ndim != 2 or raw.dtype != np.uint8:
            return source.read_label(ref), 0  # its DataError names the file and the problem
        return raw, 0
    if isinstance(source, UnifiedLabelSource):
        decoded = source.decode_label(ref)
        return decoded.label, int(sum(decoded.unknown.values()))
    return source.read_label(ref), 0


# -- the wire: flat numbers only ---------------------------------------------------------------


def statistics_to_record(stats: Mapping[str, Any]) -> dict[str, int | float | list]:
    """A site's statistics as flat ``"<split>/<field>"`` numbers and lists of numbers (a
    MetricRecord's values): sizes as ``[H, W, frames, H, W, frames, ...]``."""
    record: dict[str, int | float | list] = {"binary": int(stats["binary"])}
    for split, numbers in stats["splits"].items():
        for name in (*COUNT_FIELDS, *SHARE_FIELDS):
            record[f"{split}/{name}"] = numbers[name]
        record[f"{split}/class_share"] = [float(v) for v in numbers["class_share"]]
        record[f"{split}/outside_values"] = [int(v) for v in numbers["outside_values"]]
        for name in COLOUR_FIELDS:
            record[f"{split}/{name}"] = [float(v) for v in numbers[name]]
        for name in SIZE_FIELDS:
            record[f"{split}/{name}"] = [
                int(x) for size, n in numbers[name].items() for x in (*size.split("x"), n)
            ]
    return record


def statistics_from_record(record: Mapping[str, Any], site: str) -> dict[str, Any]:
    """The statistics a site sent (:func:`statistics_to_record`), every number checked: counts
    non-negative integers with sampled <= labelled <= frames, shares fractions summing to 1
    with the classes, colours within 0..255, sizes positive. ValueError naming the site, the
    field and the value otherwise."""

    def bad(field: str, value: object, expected: str) -> ValueError:
        return ValueError(f"site {site}: statistics field {field}={value!r}: expected {expected}")

    if record.get("binary") not in (0, 1):
        raise bad("binary", record.get("binary"), "0 or 1")
    binary = bool(record["binary"])
    names = _class_names(binary)
    splits: dict[str, dict[str, Any]] = {}
    for split in sorted({key.split("/", 1)[0] for key in record if "/" in key}):
        if split not in SPLITS:
            raise bad(f"{split}/...", split, f"a split of {SPLITS}")

        def value(name: str, split: str = split) -> Any:
            key = f"{split}/{name}"
            if key not in record:
                raise bad(key, None, "a value (the field is missing)")
            return record[key]

        numbers: dict[str, Any] = {}
        for name in COUNT_FIELDS:
            v = value(name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(f"{split}/{name}", v, "a non-negative integer")
            numbers[name] = v
        if not numbers["sampled_frames"] <= numbers["labelled_frames"] <= numbers["frames"]:
            raise bad(f"{split}/labelled_frames", numbers, "sampled <= labelled <= frames")
        shares = _numbers(value("class_share"), len(names), 0.0, 1.0)
        if shares is None:
            raise bad(f"{split}/class_share", value("class_share"), f"{len(names)} fractions")
        numbers["class_share"] = shares
        for name in SHARE_FIELDS:
            checked = _numbers([value(name)], 1, 0.0, 1.0)
            if checked is None:
                raise bad(f"{split}/{name}", value(name), "a fraction in [0, 1]")
            numbers[name] = checked[0]
        total = sum(shares) + numbers["ignore_share"] + numbers["outside_share"]
        if numbers["sampled_frames"] and abs(total - 1.0) > 1e-3:
            raise bad(f"{split}/class_share", shares, f"shares summing to 1 (sum {total:.4f})")
        outside = value("outside_values")
        if not isinstance(outside, list) or not all(
            isinstance(v, int) and len(names) <= v <= 255 for v in outside
        ):
            raise bad(f"{split}/outside_values", outside, f"values in {len(names)}..255")
        numbers["outside_values"] = outside
        for name in COLOUR_FIELDS:
            checked = _numbers(value(name), 3, 0.0, 255.0)
            if checked is None:
                raise bad(f"{split}/{name}", value(name), "3 numbers in [0, 255] (R, G, B)")
            numbers[name] = checked
        for name in SIZE_FIELDS:
            flat = value(name)
            if (
                not isinstance(flat, list)
                or len(flat) % 3
                or not all(isinstance(v, int) and v > 0 for v in flat)
            ):
                raise bad(f"{split}/{name}", flat, "[H, W, frames, ...] positive integers")
            numbers[name] = {f"{h}x{w}": n for h, w, n in zip(*[iter(flat)] * 3, strict=True)}
        splits[split] = numbers
    for split in SPLITS:
        if split not in splits and split not in OPTIONAL_SPLITS:
            raise bad(f"{split}/frames", None, f"statistics of the {split} split")
    return {"binary": binary, "classes": list(names), "splits": splits}


def _numbers(values: object, length: int, low: float, high: float) -> list[float] | None:
    """``values`` as ``length`` finite floats within [low, high], else None."""
    if not isinstance(values, list) or len(values) != length:
        return None
    if not all(
        isinstance(v, int | float) and not isinstance(v, bool) and np.isfinite(v) for v in values
    ):
        return None
    floats = [float(v) for v in values]
    return floats if all(low - 1e-9 <= v <= high + 1e-9 for v in floats) else None


# -- across the federation ---------------------------------------------------------------------


def encoding_warnings(stats: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per site whose labels look written in another encoding (module docstring):
    ``stats`` maps site -> :func:`site_statistics`'s dict."""
    warnings: list[str] = []
    present: dict[str, set[str]] = {}  # part-labelled site -> foreground classes it shows
    for site, site_stats in stats.items():
        names = site_stats["classes"]
        totals = np.zeros(len(names))
        for split, numbers in site_stats["splits"].items():
            totals += np.array(numbers["class_share"]) * numbers["sampled_frames"]
            if numbers["outside_share"] > 0:
                listed = numbers["outside_values"] or "unknown decoded values"
                warnings.append(
                    f"site {site}: {100 * numbers['outside_share']:.2f} % of the {split} label "
                    f"pixels hold {listed}, outside the classes 0..{len(names) - 1} and ignore "
                    f"{IGNORE_INDEX}: its labels look written in another encoding (map them to "
                    "0 background, 1 shaft, 2 wrist, 3 jaw)"
                )
            if set(numbers["label_sizes"]) != set(numbers["frame_sizes"]):
                warnings.append(
                    f"site {site}: {split} labels are {sorted(numbers['label_sizes'])} but its "
                    f"frames {sorted(numbers['frame_sizes'])}: labels of another size or crop"
                )
        if not site_stats["binary"]:
            present[site] = {names[c] for c in range(1, len(names)) if totals[c] > 0}
    for site, classes in present.items():
        others = [present[o] for o in present if o != site]
        if not others:
            continue
        for name in CLASS_NAMES[1:]:
            if name not in classes and all(name in other for other in others):
                warnings.append(
                    f"site {site}: no {name} pixel in its sampled labels while every other "
                    f"part-labelled site has {name}: its labels look written in another "
                    "encoding (a class merged into another or numbered differently)"
                )
    return warnings


def format_statistics(stats: Mapping[str, Mapping[str, Any]]) -> str:
    """A markdown table: one row per site and split."""
    header = (
        "| site | split | videos | frames | labelled | sampled | class share (%) | ignore (%) "
        "| outside (%) | RGB mean | RGB std | frame sizes |"
    )
    lines = [header, "|" + "---|" * 12]
    for site, site_stats in stats.items():
        names = site_stats["classes"]
        for split, n in site_stats["splits"].items():
            shares = " ".join(
                f"{name} {100 * v:.1f}" for name, v in zip(names, n["class_share"], strict=True)
            )
            sizes = ", ".join(f"{size} ({count})" for size, count in n["frame_sizes"].items())
            lines.append(
                f"| {site} | {split} | {n['videos']} | {n['frames']} | {n['labelled_frames']} "
                f"| {n['sampled_frames']} | {shares} | {100 * n['ignore_share']:.2f} "
                f"| {100 * n['outside_share']:.2f} "
                f"| {' '.join(f'{v:.0f}' for v in n['colour_mean'])} "
                f"| {' '.join(f'{v:.0f}' for v in n['colour_std'])} | {sizes} |"
            )
    return "\n".join(lines)


# -- the command -------------------------------------------------------------------------------


ARGUMENTS = ("data", "site", "sample_frames")


def main(argv: Sequence[str] | None = None) -> int:
    """Print the statistics of the configured sites and the encoding warnings."""
    from fedst.data.check import DEFAULT_DATA, load_data_config, parse_arguments

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(item in ("-h", "--help") for item in argv):
        print(__doc__)
        return 0
    args = parse_arguments(argv, ARGUMENTS)
    config = load_data_config(args.get("data", DEFAULT_DATA))
    names = [args["site"]] if "site" in args else list(config.sites)
    for name in names:
        if name not in config.sites:
            raise ConfigError(
                f"site={name}: not in the data config{did_you_mean(name, config.sites)}; sites: "
                f"{', '.join(sorted(config.sites))}"
            )
    try:
        sample_frames = int(args.get("sample_frames", DEFAULT_SAMPLE_FRAMES))
    except ValueError as err:
        raise ConfigError(f"sample_frames={args['sample_frames']}: expected an integer") from err
    stats = {name: site_statistics(config.open(name), sample_frames) for name in names}
    print(format_statistics(stats))
    for line in encoding_warnings(stats):
        print(f"WARNING {line}")
    return 0


if __name__ == "__main__":
    from fedst.errors import run_entry_point

    run_entry_point(main, "python -m fedst.data.stats")

"""Dataset checker: what each configured site holds on disk, and every problem with its file.

    python -m fedst.data.check                          # data=demo: the benchmark `make demo` writes
    python -m fedst.data.check data=paper [site=A] [max_frames=50]
    python -m fedst.data.check data=configs/data/my_sites.yaml --max-frames 20

``data=<name>`` loads ``configs/data/<name>.yaml``; ``data=<file.yaml>`` loads that file. The
default is ``data=demo``, as train_fed.py's: the procedural benchmark ``make demo`` generates
(data/procedural/demo_v2); ``data=paper`` checks the real datasets where configs/data/paper.yaml
expects them. For each site (or only ``site=X``) the checker lists the videos, frames and labelled
frames per split and the frame rate the clips will use (median spacing of the frame times), checks
that every listed frame file exists, and runs the validation train_fed.py runs before training
(fedst/data/validation.py, the same code, with the paper's clips: 4 frames 0.2 s apart): every
labelled frame and every clip context frame decoded in full (truncated JPEG/PNG, frames under
8 px), every label read (values, unknown values or colours with their pixel counts, size against
its frame). Only the splits the site's config uses are read: those its role needs (federation:
train and test; out-of-federation: test; server: train), where problems are errors, and a
federated site's val split (validation and model selection, with ``data.val_split: dataset``),
where they are warnings; a site with no role is checked in every split. A sample of labelled frames
(at most ``max_frames`` per site, spread over those splits) gives the resolution, the class pixel
shares, the stored label formats and the unknown values a site maps to 255 with
``on_unknown_label: ignore`` (warnings).

The exit status is 1 when a site cannot be used (any error), 2 for a bad command line or config,
0 otherwise.
"""

from __future__ import annotations

import logging
import math
import shutil
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console
from rich.progress import track
from rich.table import Table

from fedst.config import ConfigError, build, did_you_mean
from fedst.data._io import UnifiedLabelSource, format_counts, natural_key, read_image_any
from fedst.data.base import (
    CLASS_NAMES,
    IGNORE_INDEX,
    SPLITS,
    DataError,
    FrameRef,
    LabelRef,
    SiteSource,
    VideoRecord,
)
from fedst.data.clips import ClipConfig
from fedst.data.registry import open_site
from fedst.data.site_checks import required_splits, site_roles, split_problems
from fedst.data.sites import DataConfig, SiteSpec

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "data"
DEFAULT_DATA = "demo"
"""The data config checked without ``data=``: train_fed.py's default (configs/config.yaml)."""
DEFAULT_MAX_FRAMES = 50
"""Labelled frames read per site by default."""
ARGUMENTS = ("data", "site", "max_frames")
MISSING_FILES_SHOWN = 5


@dataclass
class Problem:
    """One finding: ``error`` makes the site unusable, ``warning`` does not."""

    severity: str
    file: str
    message: str


@dataclass
class SplitSummary:
    videos: int
    frames: int
    labelled: int


@dataclass
class SiteReport:
    """What the checker found for one site."""

    name: str
    backend: str
    root: str
    roles: tuple[str, ...]
    splits: dict[str, SplitSummary] = field(default_factory=dict)
    """The splits the site's config uses (:func:`used_splits`), read and checked."""
    clip_fps: float | None = None
    resolutions: Counter = field(default_factory=Counter)
    class_pixels: np.ndarray = field(default_factory=lambda: np.zeros(256, dtype=np.int64))
    frames_read: int = 0
    label_formats: Counter = field(default_factory=Counter)
    """Stored form of the sampled label files: "grey", "RGB", "RGBA" (what is on disk)."""
    raw_values: set[str] = field(default_factory=set)
    """Raw values (grey) or colours (RGB) seen in the sampled label files."""
    binary: bool = False
    problems: list[Problem] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    def error(self, file: object, message: str) -> None:
        self.problems.append(Problem("error", str(file), message))

    def warning(self, file: object, message: str) -> None:
        self.problems.append(Problem("warning", str(file), message))

    def class_shares(self) -> dict[str, float]:
        """Percent of read label pixels per class (and ``ignore``)."""
        total = int(self.class_pixels.sum())
        names = ("background", "instrument") if self.binary else CLASS_NAMES
        counts = {n: int(self.class_pixels[i]) for i, n in enumerate(names)}
        counts["ignore"] = int(self.class_pixels[IGNORE_INDEX])
        return {n: 100.0 * c / total if total else math.nan for n, c in counts.items()}


def load_data_config(spec: str) -> DataConfig:
    """``paper`` -> configs/data/paper.yaml; a path to a .yaml file is loaded as it is."""
    path = Path(spec)
    if not (path.suffix in (".yaml", ".yml") or path.is_file()):
        path = CONFIG_DIR / f"{spec}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError(
            f"data={spec}: {path} not found{did_you_mean(spec, names)}; give one of "
            f"{', '.join(names)} (configs/data/) or a path to a .yaml file"
        )
    try:
        wrapped = OmegaConf.create({"data": OmegaConf.load(path)})  # resolves ${data.root}
        values = OmegaConf.to_container(wrapped, resolve=True)["data"]
    except (yaml.YAMLError, OmegaConfBaseException, UnicodeDecodeError) as err:
        raise ConfigError(f"data config {path}: not a valid YAML mapping ({err})") from err
    if not isinstance(values, dict):
        raise ConfigError(f"data config {path}: expected a YAML mapping, found {values!r}")
    return build(DataConfig, values, where=f"data ({path})")


def used_splits(config: DataConfig, name: str) -> tuple[str, ...]:
    """The splits of site ``name`` that its config uses, in :data:`SPLITS` order: those its roles
    need, and a federated site's val split where ``data.val_split`` is dataset (validation and
    selection read it); every split for a site with no role."""
    roles = site_roles(config, name)
    if not roles:
        return SPLITS
    used = set(required_splits(roles))
    if "federation" in roles and config.val_split == "dataset":
        used.add("val")
    return tuple(split for split in SPLITS if split in used)


def check_site(
    name: str,
    spec: SiteSpec,
    roles: tuple[str, ...],
    max_frames: int,
    show_progress: bool,
    splits: Sequence[str] = SPLITS,
) -> SiteReport:
    """Open site ``name`` through the registry and check its ``splits`` (those its config uses,
    :func:`used_splits`); every problem lands in the report."""
    report = SiteReport(name, spec.backend, spec.root, roles)
    warnings = _WarningCollector()
    data_logger = logging.getLogger("fedst.data")
    data_logger.addHandler(warnings)
    try:
        _check_site(report, spec, max_frames, show_progress, splits)
    finally:
        data_logger.removeHandler(warnings)
    for message in warnings.messages:
        report.warning(spec.root, message)
    return report


class _WarningCollector(logging.Handler):
    """Collects the backends' logged warnings (e.g. a skipped video) for the report."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _check_site(
    report: SiteReport, spec: SiteSpec, max_frames: int, show_progress: bool, splits: Sequence[str]
) -> None:
    name, roles = report.name, report.roles
    try:
        source = open_site(spec.backend, Path(spec.root), name, **spec.options)
    except (DataError, ConfigError, TypeError, OSError) as err:
        report.error(spec.root, f"cannot open the site: {err}")
        return
    report.binary = source.binary
    videos: dict[str, list[VideoRecord]] = {}
    for split in splits:
        try:
            videos[split] = source.videos(split)
        except (DataError, OSError) as err:
            needed = split in required_splits(roles)
            report.problems.append(
                Problem("error" if needed else "warning", spec.root, f"split {split}: {err}")
            )
            videos[split] = []
        records = videos[split]
        report.splits[split] = SplitSummary(
            len(records), sum(len(v.frames) for v in records), sum(len(v.labels) for v in records)
        )
    _check_required_splits(report)
    report.clip_fps = _clip_fps([v for records in videos.values() for v in records])
    _check_frame_files(report, videos)
    _validate_splits(report, source, videos)
    samples = _sample_labels(videos, max_frames)
    if show_progress and samples:
        samples = track(
            samples, description=f"site {name}", console=Console(stderr=True), transient=True
        )
    for video, position in samples:
        _check_sample(report, source, video.frames[position], video.labels[position])


def _check_required_splits(report: SiteReport) -> None:
    if not report.roles and not any(s.labelled for s in report.splits.values()):
        report.error(report.root, "no labelled frames in any split")
    for split in sorted(required_splits(report.roles)):
        if report.splits[split].labelled == 0:
            report.error(
                report.root,
                f"split {split} is empty (no labelled frames) but the "
                f"site's role {list(report.roles) or 'none'} needs it",
            )


def _clip_fps(records: list[VideoRecord]) -> float | None:
    """1 / median spacing of consecutive frame times over all videos (None: single images)."""
    gaps = np.concatenate([np.diff(v.times) for v in records if len(v.times) > 1] or [[]])
    return float(1.0 / np.median(gaps)) if gaps.size else None


def _validate_splits(
    report: SiteReport, source: SiteSource, videos: dict[str, list[VideoRecord]]
) -> None:
    """The validation train_fed.py runs before training (fedst/data/validation.py), on every split
    of ``videos`` with labels and the paper's clips (ClipConfig defaults): an error in a split the
    site's role needs, a warning in another split."""
    needed = required_splits(report.roles) if report.roles else list(SPLITS)
    for split in videos:
        if not any(v.labels for v in videos[split]):
            continue
        problems, _ = split_problems(source, split, ClipConfig())
        severity = "error" if split in needed else "warning"
        for problem in problems:
            file, _, message = problem.partition(": ")
            report.problems.append(Problem(severity, file, f"{message} (split {split})"))


def _check_frame_files(report: SiteReport, videos: dict[str, list[VideoRecord]]) -> None:
    paths = {f.path for records in videos.values() for v in records for f in v.frames}
    missing = sorted(p for p in paths if not p.is_file())
    if missing:
        shown = ", ".join(str(p) for p in missing[:MISSING_FILES_SHOWN])
        report.warning(
            missing[0],
            f"{len(missing)} listed frame file(s) missing: {shown} (an error below where a clip "
            "uses one)",
        )


def _sample_labels(
    videos: dict[str, list[VideoRecord]], max_frames: int
) -> list[tuple[VideoRecord, int]]:
    """Up to ``max_frames`` labelled frames, spread evenly over the non-empty splits of
    ``videos``."""
    per_split = {
        split: [(v, p) for v in records for p in sorted(v.labels)]
        for split, records in videos.items()
    }
    non_empty = [s for s in per_split if per_split[s]]
    if not non_empty or max_frames <= 0:
        return []
    quota = max(1, max_frames // len(non_empty))
    chosen = []
    for split in non_empty:
        items = per_split[split]
        picks = np.unique(np.linspace(0, len(items) - 1, min(quota, len(items))).round())
        chosen.extend(items[int(i)] for i in picks)
    return chosen


def _check_sample(report: SiteReport, source: SiteSource, frame: FrameRef, label: LabelRef) -> None:
    """Statistics of one labelled frame (resolution, class pixels, raw label values) and the
    warning for unknown values mapped to 255; errors come from :func:`_validate_splits`."""
    try:
        image = source.read_frame(frame)
        if isinstance(source, UnifiedLabelSource):
            decoded = source.decode_label(label)
            if decoded.unknown and source.on_unknown_label != "error":
                report.warning(
                    label.path,
                    f"unknown label value(s) {format_counts(decoded.unknown)} (value: pixels) "
                    "mapped to 255 (on_unknown_label: ignore)",
                )
            mask = decoded.label
        else:
            mask = source.read_label(label)
    except (DataError, OSError):
        return  # reported by the validation
    report.resolutions[f"{image.shape[1]}x{image.shape[0]}"] += 1
    report.frames_read += 1
    _record_raw_label(report, label)
    report.class_pixels += np.bincount(mask.ravel(), minlength=256)


def _record_raw_label(report: SiteReport, label: LabelRef) -> None:
    """Note how a single-file label is stored (grey / RGB / RGBA) and its raw values."""
    if not label.path.is_file() or label.path.suffix.lower() != ".png":
        return  # combined instrument folders, COCO files: nothing single to describe
    raw = read_image_any(label.path)
    if raw.ndim == 2:
        report.label_formats["grey"] += 1
        report.raw_values.update(str(int(v)) for v in np.flatnonzero(np.bincount(raw.ravel())))
        return
    report.label_formats["RGBA" if raw.shape[2] == 4 else "RGB"] += 1
    colours = np.unique(raw[:, :, :3].reshape(-1, 3), axis=0)
    report.raw_values.update(str(tuple(int(c) for c in colour)) for colour in colours)


def print_reports(reports: list[SiteReport], console: Console) -> None:
    """A summary table, then every problem with its file."""
    table = Table(title="FedST dataset check")
    for column in (
        "site",
        "backend",
        "role",
        "split: videos/frames/labelled",
        "resolution",
        "clip fps",
        "class share % (sampled)",
        "status",
    ):
        table.add_column(column)
    for r in reports:
        splits = "\n".join(  # none read: the site could not be opened
            f"{s}: {v.videos}/{v.frames}/{v.labelled}"
            if (v := r.splits.get(s))
            else f"{s}: not used"
            for s in SPLITS
            if r.splits
        )
        fps = "single images" if r.clip_fps is None else f"{r.clip_fps:.3g} Hz"
        shares = "\n".join(f"{k} {v:.2f}" for k, v in r.class_shares().items() if not math.isnan(v))
        resolution = ", ".join(f"{k} ({n})" for k, n in r.resolutions.most_common(3))
        errors = sum(p.severity == "error" for p in r.problems)
        warnings = len(r.problems) - errors
        status = "OK" if r.usable else "UNUSABLE"
        status += f" ({errors} err, {warnings} warn)" if r.problems else ""
        table.add_row(
            r.name,
            r.backend,
            ", ".join(r.roles) or "-",
            splits or "-",
            resolution or "-",
            fps if r.splits else "-",
            shares or "-",
            status,
        )
    console.print(table)
    for r in reports:
        for p in r.problems:
            print(f"[{r.name}] {p.severity.upper()}: {p.file}: {p.message}")
        if r.frames_read:
            print(f"[{r.name}] read {r.frames_read} labelled frame(s) from {r.root}")
        if r.label_formats:
            formats = ", ".join(f"{k} {n}" for k, n in r.label_formats.most_common())
            values = sorted(r.raw_values, key=natural_key)
            print(f"[{r.name}] label files: {formats}; raw values: {', '.join(values)}")


def parse_arguments(argv: Sequence[str], known: Sequence[str] = ARGUMENTS) -> dict[str, str]:
    """``key=value`` (Hydra style, an optional leading + allowed) and ``--max-frames N`` for
    the keys ``known`` (this command's; fedst.data.stats passes its own)."""
    values: dict[str, str] = {}
    items = list(argv)
    while items:
        item = items.pop(0)
        if item.startswith("--"):
            key = item[2:].replace("-", "_")
            if "=" in key:
                key, value = key.split("=", 1)
            elif items:
                value = items.pop(0)
            else:
                raise ConfigError(f"argument {item} needs a value")
        elif "=" in item:
            key, value = item.lstrip("+").split("=", 1)
        else:
            raise ConfigError(f"argument {item!r}: use key=value with keys {known}")
        if key not in known:
            raise ConfigError(
                f"unknown argument {key!r}{did_you_mean(key, known)}; known: {', '.join(known)}"
            )
        values[key] = value
    return values


def main(argv: Sequence[str] | None = None) -> int:
    """Check the sites of a data config; the exit status says whether every site is usable."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(item in ("-h", "--help") for item in argv):
        print(
            "usage: python -m fedst.data.check [data=NAME|FILE.yaml] [site=NAME] [max_frames=N]\n"
            f"  data: a config of configs/data/ or a .yaml file (default: {DEFAULT_DATA}, the "
            "benchmark `make demo` writes; paper: the real datasets)\n"
        )
        print(__doc__)
        return 0
    # a mistake (ConfigError) ends in the entry point's one line, exit status 2
    args = parse_arguments(argv)
    config = load_data_config(args.get("data", DEFAULT_DATA))
    try:
        max_frames = int(args.get("max_frames", DEFAULT_MAX_FRAMES))
    except ValueError as err:
        raise ConfigError(f"max_frames={args['max_frames']}: expected an integer") from err
    names = [args["site"]] if "site" in args else list(config.sites)
    unknown = [n for n in names if n not in config.sites]
    if unknown:
        raise ConfigError(
            f"site={unknown[0]}: not in the data config{did_you_mean(unknown[0], config.sites)}; "
            f"sites: {', '.join(sorted(config.sites))}"
        )
    reports = [
        check_site(
            n,
            config.sites[n],
            site_roles(config, n),
            max_frames,
            sys.stderr.isatty(),
            used_splits(config, n),
        )
        for n in names
    ]
    print_reports(reports, Console(width=shutil.get_terminal_size((160, 24)).columns))
    unusable = [r.name for r in reports if not r.usable]
    if unusable:
        print(f"unusable site(s): {unusable}")
        if config.procedural is not None and not Path(str(config.root)).is_dir():
            print(
                f"{config.root}: the procedural benchmark is not generated yet: python -m "
                f"fedst.data.procedural --out {config.root} --preset {config.procedural} --seed 0 "
                f"--version {config.generator_version} writes it (train_fed.py and make demo do "
                "when they start)"
            )
        return 1
    print(f"all {len(reports)} site(s) usable")
    return 0


if __name__ == "__main__":
    from fedst.errors import run_entry_point

    run_entry_point(main, "python -m fedst.data.check")

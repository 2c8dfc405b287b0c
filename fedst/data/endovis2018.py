"""EndoVis2018 Robotic Scene Segmentation (site B: porcine nephrectomy).

Layout (reference/datasets.md, section B)::

    <root>/<release folder>/seq_k/left_frames/frame000.png .. frame148.png   (k = 1..16, no 8)
    <root>/<release folder>/seq_k/labels/frameNNN.png                        RGB or RGBA colours
    <root>/**/labels.json                                                    colour table (searched)
    <root>/test/[<any folder>/]seq_{1..4}/{left_frames,labels}/              official test set
    <root>/**/repairs/seq_k/[labels/]frameNNN.png                            extracted repairs.zip

Release folder names vary between copies, so training sequences are every ``seq_*`` folder at most
one level below ``root`` (outside the test and repairs folders); ``root`` may also hold the
``seq_*`` folders directly. The test set is found the same way under ``test_dir`` (default
``<root>/test``; an absolute path may point anywhere).

Labels are matched EXACTLY, colour by colour, against ``labels.json`` (alpha dropped, never via a
grey conversion): instrument-shaft -> 1, instrument-wrist -> 2, instrument-clasper -> 3, every
other listed colour -> 0. ``labels.json`` is searched under the roots; the documented table
(:data:`BUILTIN_COLOURS`) is used only with the option ``labels_json: builtin``. Repairs: when a
folder named ``repairs`` exists (or ``repairs_dir`` is given), a file
``repairs/seq_k/labels/frameNNN.png`` (or ``repairs/seq_k/frameNNN.png``) replaces the label of
training sequence k; ``repairs.zip`` itself is not read: extract it into ``<root>/repairs``.

Frames were sampled at 2 Hz, so ``times = frame_number * 0.5 s``.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from fedst.data._io import (
    DecodedLabel,
    UnifiedLabelSource,
    check_policy,
    decode_colours,
    natural_key,
    read_colour_mask,
    reject_unknown_options,
    require_dir,
    trailing_number,
)
from fedst.data.base import DataError, FrameRef, LabelRef, VideoRecord

log = logging.getLogger(__name__)

FRAME_PERIOD_S = 0.5
"""Released frames are 2 Hz samples of the 60 Hz video."""
PART_BY_NAME = {"instrument-shaft": 1, "instrument-wrist": 2, "instrument-clasper": 3}
"""labels.json class name -> unified class; every other listed class is background."""
BUILTIN_COLOURS: dict[tuple[int, int, int], int] = {
    (0, 0, 0): 0,  # background-tissue
    (0, 255, 0): 1,  # instrument-shaft
    (0, 255, 255): 3,  # instrument-clasper
    (125, 255, 12): 2,  # instrument-wrist
    (255, 55, 0): 0,  # kidney-parenchyma
    (24, 55, 125): 0,  # covered-kidney
    (187, 155, 25): 0,  # thread
    (0, 255, 125): 0,  # clamps
    (255, 255, 125): 0,  # suturing-needle
    (123, 15, 175): 0,  # suction-instrument
    (124, 155, 5): 0,  # small-intestine
    (12, 255, 141): 0,  # ultrasound-probe
}
"""The published colour table (reference/datasets.md); used only with labels_json: builtin."""
_SEQ_DIR = re.compile(r"seq_(\d+)$")


class EndoVis2018Source(UnifiedLabelSource):
    """EndoVis2018 as a SiteSource; see the module docstring for layout and colour decoding.

    Options: ``test_dir`` (test set folder, relative to ``root`` or absolute), ``labels_json``
    (None: search; a path; or ``builtin``), ``repairs`` (use repaired labels when found),
    ``repairs_dir`` (explicit repairs folder), ``on_unknown_label``.
    """

    def __init__(
        self,
        root: Path,
        name: str,
        *,
        surgery_type: str = "nephrectomy",
        test_dir: str = "test",
        labels_json: str | None = None,
        repairs: bool = True,
        repairs_dir: str | None = None,
        on_unknown_label: str = "error",
        **unknown_options: Any,
    ) -> None:
        reject_unknown_options(type(self), name, unknown_options)
        self.name = name
        self.surgery_type = surgery_type
        self.root = require_dir(
            Path(root), f"site {name!r}: EndoVis2018 root", "see data/README.md (site B)"
        )
        self.test_dir = self.root / test_dir
        self.on_unknown_label = check_policy(on_unknown_label, name)
        self.colours = self._load_colours(labels_json)
        self._repairs_found = self._find_repairs(repairs_dir)
        self.repairs_dir = self._repairs_found if repairs else None
        """Folder whose labels replace the originals, or None."""
        self._cache: dict[str, list[VideoRecord]] = {}

    # --- colour table and repairs ---------------------------------------------------------

    def _load_colours(self, labels_json: str | None) -> dict[tuple[int, int, int], int]:
        if labels_json == "builtin":
            log.info("site %s: using the built-in EndoVis2018 colour table", self.name)
            return dict(BUILTIN_COLOURS)
        if labels_json is not None:
            path = self.root / labels_json
            if not path.is_file():
                raise DataError(
                    f"site {self.name!r}: option labels_json={labels_json!r}: {path} does not exist"
                )
            return _parse_labels_json(path)
        roots = [self.root, *([self.test_dir] if self.root not in self.test_dir.parents else [])]
        found = sorted({p for r in roots if r.is_dir() for p in r.rglob("labels.json")})
        if not found:
            raise DataError(
                f"site {self.name!r}: no labels.json under {self.root} (it ships with the "
                "EndoVis2018 training data); copy it there, point the option labels_json at it, or "
                "set labels_json: builtin to use the documented colour table"
            )
        tables = {p: _parse_labels_json(p) for p in found}
        first = found[0]
        for path, table in tables.items():
            if table != tables[first]:
                raise DataError(
                    f"{path} and {first} define different colour tables; keep one, or point the "
                    "option labels_json at the right file"
                )
        return tables[first]

    def _find_repairs(self, repairs_dir: str | None) -> Path | None:
        if repairs_dir is not None:
            return require_dir(
                self.root / repairs_dir, f"site {self.name!r}: option repairs_dir", "fix the path"
            )
        found = sorted(p for p in self.root.rglob("repairs") if p.is_dir())
        if len(found) > 1:
            raise DataError(
                f"site {self.name!r}: several repairs folders {found}; set option repairs_dir"
            )
        if not found and any(self.root.rglob("repairs.zip")):
            log.warning(
                "site %s: found repairs.zip but no extracted repairs folder; extract it into "
                "%s/repairs to use the corrected labels of seq_1 and seq_4",
                self.name,
                self.root,
            )
        return found[0] if found else None

    # --- listing --------------------------------------------------------------------------

    def videos(self, split: str) -> list[VideoRecord]:
        """Training sequences (``train``), the official test set (``test``); ``val`` is empty."""
        if split not in self._cache:
            if split == "train":
                repairs = [self._repairs_found] if self._repairs_found else []
                excluded = [self.test_dir, *repairs]
                found = _find_sequences(self.root, excluded)
                self._cache[split] = [
                    self._video(f"seq_{k}", folder, repaired=True) for k, folder in found.items()
                ]
            elif split == "test":
                if not self.test_dir.is_dir():
                    log.warning("site %s: no test folder %s", self.name, self.test_dir)
                    self._cache[split] = []
                else:
                    found = _find_sequences(self.test_dir, [])
                    self._cache[split] = [
                        self._video(f"test_seq_{k}", folder, repaired=False)
                        for k, folder in found.items()
                    ]
            elif split == "val":
                self._cache[split] = []
            else:
                raise DataError(f"site {self.name!r}: unknown split {split!r}")
            self._cache[split] = [v for v in self._cache[split] if v.labels]
        return self._cache[split]

    def _video(self, video_id: str, folder: Path, repaired: bool) -> VideoRecord:
        frames_dir = require_dir(folder / "left_frames", "EndoVis2018 frames", "see data/README.md")
        labels_dir = require_dir(folder / "labels", "EndoVis2018 labels", "see data/README.md")
        frames = {
            trailing_number(p.stem, p): p
            for p in frames_dir.iterdir()
            if p.suffix.lower() == ".png" and p.stem.startswith("frame")
        }
        if not frames:
            raise DataError(f"{frames_dir}: no frameNNN.png files")
        numbers = sorted(frames)
        labels: dict[int, LabelRef] = {}
        replaced = 0
        for position, number in enumerate(numbers):
            label_file = labels_dir / frames[number].name
            repair = self._repair_file(folder.name, frames[number].name) if repaired else None
            if repair is not None:
                label_file, replaced = repair, replaced + 1
            if label_file.is_file():
                labels[position] = LabelRef(label_file)
        if replaced:
            log.info("site %s: %d repaired label(s) used for %s", self.name, replaced, video_id)
        if len(labels) < len(frames):
            log.warning("%s: %d frame(s) without a label", labels_dir, len(frames) - len(labels))
        return VideoRecord(
            video_id=video_id,
            times=[n * FRAME_PERIOD_S for n in numbers],
            frames=[FrameRef(frames[n]) for n in numbers],
            labels=labels,
        )

    def _repair_file(self, sequence: str, file_name: str) -> Path | None:
        if self.repairs_dir is None:
            return None
        for candidate in (
            self.repairs_dir / sequence / "labels" / file_name,
            self.repairs_dir / sequence / file_name,
        ):
            if candidate.is_file():
                return candidate
        return None

    # --- reading --------------------------------------------------------------------------

    def decode_label(self, ref: LabelRef) -> DecodedLabel:
        """Unified map [H, W] from an RGB(A) colour label [H, W, 3|4], matched exactly."""
        return decode_colours(read_colour_mask(ref.path), self.colours)


def _parse_labels_json(path: Path) -> dict[tuple[int, int, int], int]:
    """labels.json (a list of {"name", "color": [r, g, b], "classid"}) -> {colour: class}."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: cannot read labels.json ({err})") from err
    if not isinstance(entries, list):
        raise DataError(f"{path}: expected a JSON list of classes, found {type(entries).__name__}")
    colours: dict[tuple[int, int, int], int] = {}
    for entry in entries:
        try:
            colour = tuple(int(c) for c in entry["color"])
            class_name = str(entry["name"])
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"{path}: entry {entry!r} lacks a name or an [r, g, b] color") from err
        if len(colour) != 3:
            raise DataError(f"{path}: color {list(colour)} of {class_name!r} is not [r, g, b]")
        colours[colour] = PART_BY_NAME.get(class_name, 0)
    missing = sorted(set(PART_BY_NAME) - {e.get("name") for e in entries})
    if missing:
        raise DataError(
            f"{path}: class(es) {missing} missing; is this the EndoVis2018 labels.json?"
        )
    return colours


def _find_sequences(base: Path, excluded: list[Path]) -> dict[int, Path]:
    """seq number -> folder for ``seq_*`` folders in ``base`` or one level below it."""
    found: dict[int, Path] = {}
    candidates = [*base.glob("seq_*"), *base.glob("*/seq_*")]
    for folder in sorted(candidates, key=lambda p: natural_key(str(p))):
        match = _SEQ_DIR.match(folder.name)
        if not folder.is_dir() or match is None:
            continue
        if any(folder == e or e in folder.parents for e in excluded):
            continue
        number = int(match.group(1))
        if number in found:
            raise DataError(
                f"sequence seq_{number} found twice: {found[number]} and {folder}; keep one, or if "
                "one is the test set set the option test_dir to its folder"
            )
        found[number] = folder
    return dict(sorted(found.items()))

"""Contact sheets of sites in the generic layout, to look at data before training on it.

``python -m fedst.data.preview DIR [--out DIR/preview]`` writes, for every site folder of DIR
(a folder with meta.json), ``<site>.png``: rows = a few videos (test split first, then val, then
train), columns = consecutive frames, each shown raw and with its mask overlaid (shaft, wrist, jaw
in distinct colours; a binary site's instrument in the shaft colour; unlabelled frames marked
"no label"). It also writes ``overview.png``: the first frame of one video per site side by side,
titled with the site and its surgery type. Reads the layout directly (meta.json, splits, videos)
so it also works on a half-built site folder.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import cv2
import numpy as np

from fedst.data.base import SPLITS, DataError
from fedst.errors import ArgumentParser

__all__ = ["OVERLAY_COLOURS", "contact_sheet", "main", "overview", "write_previews"]

logger = logging.getLogger(__name__)

OVERLAY_COLOURS: dict[int, tuple[int, int, int]] = {
    1: (40, 150, 255),  # shaft: blue
    2: (255, 220, 0),  # wrist: yellow
    3: (60, 255, 60),  # jaw: green
}
"""RGB overlay colour per label value (label 1 is also a binary site's instrument)."""
OVERLAY_ALPHA = 0.55
TILE_HEIGHT = 128
TITLE_HEIGHT = 22
PNG_PARAMS = (cv2.IMWRITE_PNG_COMPRESSION, 3)


def _read_rgb(path: Path) -> np.ndarray:
    bgr = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if bgr is None:
        raise DataError(f"{path}: unreadable image; regenerate or remove the file")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def _overlay(frame: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Frame RGB [H, W, 3] with label colours blended in where ``mask`` [H, W] > 0."""
    colours = np.zeros_like(frame)
    for value, colour in OVERLAY_COLOURS.items():
        colours[mask == value] = colour
    blend = cv2.addWeighted(frame, 1 - OVERLAY_ALPHA, colours, OVERLAY_ALPHA, 0)
    return np.where((mask > 0)[..., None] & (mask != 255)[..., None], blend, frame)


def _tile(image: np.ndarray) -> np.ndarray:
    """Resize to TILE_HEIGHT rows keeping the aspect ratio (nearest neighbour: sharp masks)."""
    h, w = image.shape[:2]
    width = round(w * TILE_HEIGHT / h)
    return cv2.resize(image, (width, TILE_HEIGHT), interpolation=cv2.INTER_NEAREST)


def _text(image: np.ndarray, text: str, origin: tuple[int, int], scale: float = 0.45) -> None:
    """White text on a dark box (readable on any background)."""
    (width, height), baseline = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, scale, 1)
    x, y = origin
    cv2.rectangle(image, (x - 2, y - height - 2), (x + width + 2, y + baseline), (0, 0, 0), -1)
    cv2.putText(
        image, text, origin, cv2.FONT_HERSHEY_SIMPLEX, scale, (255, 255, 255), 1, cv2.LINE_AA
    )


def _titled(image: np.ndarray, title: str) -> np.ndarray:
    band = np.full((TITLE_HEIGHT, image.shape[1], 3), 32, np.uint8)
    _text(band, title, (4, TITLE_HEIGHT - 7))
    return np.vstack([band, image])


def _site_meta(site_dir: Path) -> dict:
    path = site_dir / "meta.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(
            f"{path}: cannot read site meta ({err}); is this a generic-layout site?"
        ) from err


def _videos(site_dir: Path) -> list[str]:
    """Video ids, test split first (then val, train), each once."""
    ordered: list[str] = []
    for split in ("test", "val", "train"):
        path = site_dir / "splits" / f"{split}.txt"
        if path.is_file():
            ordered += [v for v in path.read_text().split() if v and v not in ordered]
    return ordered


def _sheet_rows(site_dir: Path, rows: int, columns: int) -> list[list[tuple[str, Path]]]:
    """(video_id, frame path) per sheet row: ``columns`` consecutive frames of one video per row,
    or, when videos hold a single frame (independent images), ``columns`` videos per row."""
    lines: list[list[tuple[str, Path]]] = []
    singles: list[tuple[str, Path]] = []
    for video_id in _videos(site_dir):
        frames = sorted((site_dir / "videos" / video_id / "frames").glob("*.png"))
        if len(frames) == 1:
            singles.append((video_id, frames[0]))
            if len(singles) == columns:
                lines.append(singles)
                singles = []
        elif frames:
            lines.append([(video_id, path) for path in frames[:columns]])
        if len(lines) == rows:
            return lines
    return lines + ([singles] if singles else [])


def contact_sheet(site_dir: Path, rows: int = 3, columns: int = 4) -> np.ndarray:
    """RGB sheet: ``rows`` videos x ``columns`` consecutive frames, each raw | overlay."""
    meta = _site_meta(site_dir)
    sheet_rows = _sheet_rows(site_dir, rows, columns)
    if not sheet_rows:
        raise DataError(f"{site_dir}/splits: no videos with frames in {SPLITS}; nothing to preview")
    lines = []
    for items in sheet_rows:
        cells = []
        for video_id, path in items:
            frame = _tile(_read_rgb(path))
            mask_path = path.parent.parent / "masks" / path.name
            if mask_path.is_file():
                mask = cv2.imread(str(mask_path), cv2.IMREAD_UNCHANGED)
                overlay = _overlay(frame, _tile(mask))
            else:
                overlay = frame.copy()
                _text(overlay, "no label", (4, TILE_HEIGHT - 6))
            raw = frame.copy()
            _text(raw, f"{video_id} #{int(path.stem)}", (4, 14), 0.38)
            cells += [raw, overlay, np.full((TILE_HEIGHT, 2, 3), 255, np.uint8)]
        lines.append(np.hstack(cells))
    width = max(line.shape[1] for line in lines)
    lines = [np.pad(line, ((0, 2), (0, width - line.shape[1]), (0, 0))) for line in lines]
    legend = "blue instrument" if meta.get("binary") else "blue shaft, yellow wrist, green jaw"
    title = (
        f"{site_dir.name}: {meta.get('surgery_type', '?')} | fps {meta.get('fps')}, "
        f"annotated {meta.get('annotated_fps')} | {legend}"
    )
    return _titled(np.vstack(lines), title)


def overview(site_dirs: Sequence[Path]) -> np.ndarray:
    """RGB strip: the first frame of the first video of every site, titled site + surgery type."""
    tiles = []
    for site_dir in site_dirs:
        meta = _site_meta(site_dir)
        video_list = _videos(site_dir)
        frames = sorted((site_dir / "videos" / video_list[0] / "frames").glob("*.png"))
        tile = _tile(_read_rgb(frames[len(frames) // 2]))
        tile = _titled(tile, f"{site_dir.name}: {meta.get('surgery_type', '?')}")
        tiles += [tile, np.full((tile.shape[0], 3, 3), 255, np.uint8)]
    return np.hstack(tiles[:-1])


def write_previews(root: Path, out: Path | None = None) -> list[Path]:
    """Write one sheet per site under ``root`` plus overview.png into ``out``; returns the paths."""
    root = Path(root)
    out = Path(out) if out is not None else root / "preview"
    site_dirs = sorted(p.parent for p in root.glob("*/meta.json"))
    if not site_dirs:
        raise DataError(f"{root}: no site folders (*/meta.json) found; generate data first")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for site_dir in site_dirs:
        path = out / f"{site_dir.name}.png"
        _save(path, contact_sheet(site_dir))
        written.append(path)
    path = out / "overview.png"
    _save(path, overview(site_dirs))
    written.append(path)
    logger.info("wrote %d preview images to %s", len(written), out)
    return written


def _save(path: Path, rgb: np.ndarray) -> None:
    if not cv2.imwrite(str(path), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), list(PNG_PARAMS)):
        raise DataError(f"{path}: cv2.imwrite failed; check that the folder is writable")


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: ``python -m fedst.data.preview DIR [--out DIR/preview]``."""
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", type=Path, help="folder holding <site>/meta.json folders")
    parser.add_argument("--out", type=Path, default=None, help="output folder (ROOT/preview)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for path in write_previews(args.root, args.out):
        print(path)


if __name__ == "__main__":
    from fedst.errors import run_entry_point

    run_entry_point(main, "python -m fedst.data.preview")

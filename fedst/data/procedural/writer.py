"""Sites on disk, in the generic layout: :func:`generate` renders a preset's videos (in worker
processes) and writes their frames and masks, then the split files and meta.json last. A site
generated with the same (seed, preset, version) is skipped, one that differs or a folder the
generator did not write is refused (unless regenerated on purpose), an interrupted generation is
redone, and a lock per root lets concurrent runs generate a benchmark once.
:func:`generate_oracle_split` writes the diagnosis-only ``<site>_oracle`` split, never into a
benchmark folder."""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import cv2
import numpy as np

try:
    import fcntl
except ImportError:  # Windows: generation is not locked across processes
    fcntl = None

from fedst.data.base import CLASS_NAMES, IGNORE_INDEX, SPLITS, DataError
from fedst.data.procedural.render import render_video
from fedst.data.procedural.sites import (
    FPS,
    PRESETS,
    SITES,
    Preset,
    check_names,
    check_version,
    video_ids,
)
from fedst.progress import SHOW_NOW, progress_bar
from fedst.schema.data import GENERATOR_VERSION

logger = logging.getLogger("fedst.data.procedural")  # the package's name, as before the split

PNG_PARAMS = (cv2.IMWRITE_PNG_COMPRESSION, 3)
BINARY_CLASSES = ("background", "instrument")


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
    check_names(preset, names)
    check_version(version)
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
        if todo:  # where the data goes (a relative data.root is under the working directory)
            logger.info(
                "generating site(s) %s of the procedural benchmark %s into %s",
                ", ".join(todo),
                preset,
                out.absolute(),
                extra=SHOW_NOW,  # minutes of work: said as it starts, even while a run sets up
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
    check_names(preset, [site])
    check_version(version)
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

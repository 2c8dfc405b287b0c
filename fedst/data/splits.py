"""Validation splits of the training sites (model selection never reads a test split).

Where a site's validation videos come from is one config value, ``data.val_split``:

* ``dataset`` (default): the dataset's own ``val`` split. The procedural benchmark writes one
  (``splits/val.txt``: 1 video per federated site in every preset), the generic layout reads
  ``splits/val.txt``, EndoVis2017 has one with its ``fold`` option (held-out training sequences).
  EndoVis2018, SAR-RARP50 and a generic site without ``val.txt`` have none: asking them for a
  validation score stops with a message naming the site and this key.
* ``train``: ``data.val_videos`` whole videos of the site's ``train`` split become its validation
  split and leave training (the site trains on fewer videos; the dataset's own val split, if any, is
  not used). Which videos: the ``val_videos`` video ids with the smallest
  SHA-256(``"<val_seed>/<site>/<video_id>"``), so the choice depends only on the seed, the site's
  name and its video ids (not on their order on disk) and never on a test video. Whole videos, so
  no validation frame has a neighbouring frame in training.

It applies to the sites that train or select (``data.federation`` and a CBE held-out site,
``selection.held_out_site``), never to out-of-federation sites or the server's synthetic set, and
the ``test`` split is passed through untouched in both modes.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np

from fedst.data.base import DataError, FrameRef, LabelRef, SiteSource, VideoRecord
from fedst.data.clips import ClipConfig, ClipDataset

log = logging.getLogger(__name__)


def carved_video_ids(video_ids: list[str], site: str, count: int, seed: int) -> list[str]:
    """The ``count`` ids of ``video_ids`` with the smallest SHA-256 of ``"<seed>/<site>/<id>"``
    (sorted by that hash); the rule of the module docstring."""

    def rank(video_id: str) -> str:
        return hashlib.sha256(f"{seed}/{site}/{video_id}".encode()).hexdigest()

    return sorted(video_ids, key=rank)[:count]


class CarvedValidationSource(SiteSource):
    """``inner`` with ``count`` whole training videos moved from ``train`` to ``val``
    (``data.val_split=train``); ``test`` and pixel reads go to ``inner`` unchanged."""

    def __init__(self, inner: SiteSource, count: int, seed: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.surgery_type = inner.surgery_type
        self.binary = inner.binary
        self.count = count
        self.seed = seed
        self._val_ids: set[str] | None = None

    def __getattr__(self, item: str):  # backend extras (site_root, frame_size, fps, ...)
        if item == "inner":
            raise AttributeError(item)
        return getattr(self.inner, item)

    def _carved(self) -> set[str]:
        if self._val_ids is None:
            train_ids = [v.video_id for v in self.inner.videos("train")]
            if len(train_ids) <= self.count:
                raise DataError(
                    f"site {self.name!r}: data.val_split=train moves data.val_videos="
                    f"{self.count} whole training video(s) to validation, but the train split has "
                    f"only {len(train_ids)} ({train_ids}); lower data.val_videos or use the "
                    f"dataset's own val split (data.val_split=dataset)"
                )
            self._val_ids = set(carved_video_ids(train_ids, self.name, self.count, self.seed))
            log.info(
                "site %s: validation videos %s carved from its %d training videos (seed %d)",
                self.name,
                sorted(self._val_ids),
                len(train_ids),
                self.seed,
            )
        return self._val_ids

    def videos(self, split: str) -> list[VideoRecord]:
        if split == "train":
            carved = self._carved()
            return [v for v in self.inner.videos("train") if v.video_id not in carved]
        if split == "val":
            carved = self._carved()
            return [v for v in self.inner.videos("train") if v.video_id in carved]
        return self.inner.videos(split)

    def read_frame(self, ref: FrameRef) -> np.ndarray:
        return self.inner.read_frame(ref)

    def read_label(self, ref: LabelRef) -> np.ndarray:
        return self.inner.read_label(ref)


def with_validation_split(source: SiteSource, mode: str, count: int, seed: int) -> SiteSource:
    """The site as training and selection see it under ``data.val_split=mode``."""
    if mode == "train":
        return CarvedValidationSource(source, count, seed)
    return source


def validation_videos(source: SiteSource, mode: str) -> list[VideoRecord]:
    """The site's validation videos; a site without any is a DataError naming the fix."""
    try:
        videos = source.videos("val")
    except DataError as err:
        if mode == "train":
            raise
        raise DataError(
            f"site {source.name!r}: no usable validation split of its own ({err}); write one "
            f"(generic layout: splits/val.txt) or carve whole training videos with "
            f"data.val_split=train data.val_videos=N"
        ) from err
    if not any(v.labels for v in videos):
        raise DataError(
            f"site {source.name!r}: its dataset has no labelled validation video "
            f"(data.val_split={mode}); carve whole training videos with data.val_split=train "
            f"data.val_videos=N, or give the dataset a val split"
        )
    return videos


def validation_dataset(source: SiteSource, mode: str, clip: ClipConfig) -> ClipDataset:
    """The site's validation clips (no augmentation), checked by :func:`validation_videos`."""
    validation_videos(source, mode)
    return ClipDataset(source, "val", clip, None)


# -- heterogeneity control: pooled-then-resplit federation (data.partition=iid) ----------------


def iid_assignment(
    sizes: dict[str, int], seed: int, split: str
) -> dict[str, list[tuple[str, int]]]:
    """Site -> the (owner site, index in the owner's list) of the videos it gets in ``split``.

    The videos of every site of ``sizes`` (site -> its own number of videos, in federation order)
    are pooled in that order, permuted by ``numpy.random.default_rng([seed, SPLITS index])`` and
    dealt out in federation order, each site getting as many videos as it had."""
    from fedst.data.base import SPLITS

    pool = [(site, i) for site, count in sizes.items() for i in range(count)]
    order = np.random.default_rng([seed, SPLITS.index(split)]).permutation(len(pool))
    shuffled = [pool[i] for i in order]
    assignment, start = {}, 0
    for site, count in sizes.items():
        assignment[site] = shuffled[start : start + count]
        start += count
    return assignment


IID_FOLDER = "iid_s{seed}"
"""Folder, under each federated site's data root, holding the iid control's generic-layout site."""


def iid_site_root(root: str | Path, seed: int) -> Path:
    """The data root of a site in the iid control: ``<its root>/iid_s<seed>``."""
    return Path(root) / IID_FOLDER.format(seed=seed)


def materialize_iid(
    sources: dict[str, SiteSource], roots: dict[str, str], seed: int
) -> dict[str, dict[str, list[str]]]:
    """Write the iid control of the federated ``sources`` (generic layout only): for each site a
    folder ``iid_site_root(roots[site], seed) / site`` with its own meta.json, per split as many
    whole videos as it had, drawn from the pool (:func:`iid_assignment`) and linked (symlinks to
    the original video folders, named ``<owner>__<video id>``), and its split files. Returns the
    video ids per site and split. Idempotent: an existing folder with the same split files is
    kept; a different one is an error (nothing is deleted)."""
    from fedst.data.generic import GenericLayoutSource

    for site, source in sources.items():
        if not isinstance(source, GenericLayoutSource):
            raise DataError(
                f"data.partition=iid: site {site} uses backend {type(source).__name__}; the iid "
                f"control is built for generic-layout sites (the procedural benchmark) only"
            )
    fps = {site: source.fps for site, source in sources.items()}
    binary = {site: source.binary for site, source in sources.items()}
    if len(set(fps.values())) > 1 or len(set(binary.values())) > 1:
        raise DataError(
            f"data.partition=iid pools videos across sites, which needs one frame rate and one "
            f"label kind: fps {fps}, binary {binary}"
        )
    from fedst.data.base import SPLITS

    listing: dict[str, dict[str, list[str]]] = {site: {} for site in sources}
    links: dict[str, dict[str, Path]] = {site: {} for site in sources}
    for split in SPLITS:
        try:
            own = {site: source.videos(split) for site, source in sources.items()}
        except DataError:
            own = {site: [] for site in sources}  # no such split anywhere in the layout
        picks = iid_assignment({s: len(v) for s, v in own.items()}, seed, split)
        for site, chosen in picks.items():
            names = []
            for owner, index in chosen:
                video_id = own[owner][index].video_id
                name = f"{owner}__{video_id}"
                names.append(name)
                links[site][name] = sources[owner].site_root / "videos" / video_id
            listing[site][split] = names
    for site, source in sources.items():
        folder = iid_site_root(roots[site], seed) / site
        splits = folder / "splits"
        if splits.is_dir():
            found = {
                sp: (splits / f"{sp}.txt").read_text().split()
                for sp in SPLITS
                if (splits / f"{sp}.txt").exists()
            }
            wanted = {sp: ids for sp, ids in listing[site].items() if ids}
            if found != wanted:
                raise DataError(
                    f"{folder} holds another iid control ({found}); expected {wanted}. Remove "
                    f"the folder to rebuild it"
                )
            continue
        (folder / "videos").mkdir(parents=True, exist_ok=True)
        for name, target in links[site].items():
            link = folder / "videos" / name
            if not link.exists():
                link.symlink_to(target.resolve(), target_is_directory=True)
        (folder / "meta.json").write_text((source.site_root / "meta.json").read_text())
        splits.mkdir()
        for split, ids in listing[site].items():
            if ids:
                (splits / f"{split}.txt").write_text("".join(f"{i}\n" for i in ids))
        log.info("iid control: site %s written to %s (%s)", site, folder, listing[site])
    return listing

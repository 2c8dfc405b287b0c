"""The preprocessed frame cache of an experiment (issue 60, item 4; fedst/data/clips/cache.py):
every frame each site's clips read, decoded once and resized to ``clip.image_size``, as nnU-Net
preprocesses once; training reads it with ``data.cache_dir`` set.

    python -m fedst.preprocess build experiment=paper data=paper data.cache_dir=/scratch/fedst_cache
    python -m fedst.preprocess check experiment=paper data=paper data.cache_dir=/scratch/fedst_cache
    python train_fed.py experiment=paper data=paper data.cache_dir=/scratch/fedst_cache

The overrides are train_fed.py's, so the cache is built from the sources, splits and input size
the run reads (``data.val_split``, ``data.partition``, ``clip.*``). ``build`` writes the splits
each site's role reads (federation: train, test and its val split where it has one; out of
federation: test; the server's set: train) and keeps the videos already cached and unchanged;
``check`` opens them as training does and exits 1 naming the first stale file and the command to
rebuild. ``--sites A,B`` (before the overrides) limits either to those sites (a deployed site
builds its own).
"""

from __future__ import annotations

import argparse
import logging

from fedst.cli import compose_experiment
from fedst.config import ConfigError
from fedst.data.base import DataError, SiteSource
from fedst.data.clips import ClipConfig, ClipDataset
from fedst.data.clips.cache import CacheError
from fedst.data.clips.cache_build import build_site_cache
from fedst.data.site_checks import required_splits, site_roles
from fedst.data.sites import DataConfig
from fedst.errors import ArgumentParser
from fedst.experiment import ExperimentConfig

log = logging.getLogger("fedst.preprocess")


def cached_splits(data: DataConfig, name: str) -> tuple[list[str], list[str]]:
    """(the splits site ``name``'s roles need, the splits read when present: a federated site's
    val split, read by validation rounds when ``train.val_every`` is set)."""
    roles = site_roles(data, name)
    optional = ["val"] if "federation" in roles else []
    return required_splits(roles), optional


def experiment_sites(cfg: ExperimentConfig, only: list[str] | None) -> list[str]:
    """The sites the experiment reads (federation, out of federation, server), or ``only``."""
    data = cfg.data
    every = [*data.federation, *data.out_of_federation, *([data.server] if data.server else [])]
    every = list(dict.fromkeys(every))
    if only is None:
        return every
    unknown = [s for s in only if s not in every]
    if unknown:
        raise ConfigError(f"--sites {','.join(only)}: {unknown} not among the experiment's {every}")
    return only


def present_splits(
    source: SiteSource, required: list[str], optional: list[str], clip: ClipConfig
) -> list[str]:
    """``required`` and those of ``optional`` with labelled frames in ``source``."""
    splits = list(required)
    for split in optional:
        try:
            ClipDataset(source, split, clip, None, validate=False)
        except DataError as err:
            log.info("site %s: no %s split to cache (%s)", source.name, split, err)
            continue
        splits.append(split)
    return splits


def build(cfg: ExperimentConfig, sites: list[str]) -> None:
    clip = cfg.clip_config()
    for name in sites:
        source = cfg.data.open_decoded(name)
        splits = present_splits(source, *cached_splits(cfg.data, name), clip)
        summary = build_site_cache(source, splits, clip, cfg.data.cache_dir)
        print(
            f"site {name} ({', '.join(splits)}): {summary.frames} frames, {summary.labels} labels "
            f"at {clip.image_size[0]}x{clip.image_size[1]}, {summary.megabytes:.1f} MiB in "
            f"{summary.folder} ({summary.videos_written} videos written, {summary.videos_kept} "
            f"kept)"
        )


def check(cfg: ExperimentConfig, sites: list[str]) -> bool:
    """Open every site's cached splits as training does; print what is stale (a CacheError
    names the file, what differs and how to rebuild). True when every one is up to date."""
    clip, fresh = cfg.clip_config(), True
    for name in sites:
        source = cfg.data.open(name)
        splits = present_splits(cfg.data.open_decoded(name), *cached_splits(cfg.data, name), clip)
        for split in splits:
            try:
                dataset = ClipDataset(source, split, clip, None, validate=False)
            except CacheError as err:
                print(f"site {name} split {split}: STALE: {err}")
                fresh = False
                continue
            print(f"site {name} split {split}: {len(dataset)} samples, cache up to date")
    return fresh


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m fedst.preprocess",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, purpose in (
        ("build", "decode and resize every frame the sites' clips read, once"),
        ("check", "open every site's cache as training does; exit 1 naming what is stale"),
    ):
        command = commands.add_parser(name, help=purpose, description=purpose)
        command.add_argument("--sites", help="comma-separated site names (default: every site)")
        command.add_argument(
            "overrides", nargs="*", help="train_fed.py overrides, data.cache_dir among them"
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg, _ = compose_experiment(list(args.overrides))
    if cfg.data.cache_dir is None:
        raise ConfigError(
            "data.cache_dir is not set: add data.cache_dir=<folder> (where the cache goes, and "
            "where training reads it with the same override)"
        )
    sites = experiment_sites(cfg, args.sites.split(",") if args.sites else None)
    if args.command == "build":
        build(cfg, sites)
        return 0
    return 0 if check(cfg, sites) else 1


if __name__ == "__main__":
    from fedst.errors import run_entry_point

    run_entry_point(main, "python -m fedst.preprocess")

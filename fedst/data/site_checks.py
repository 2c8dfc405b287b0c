"""Whether an experiment's sites can be used for their roles: the splits each role needs
(federation: train and test; out of federation: test; server: train), each validated in full by
:mod:`fedst.data.validation` before anything trains (``train_fed.py``) or on request
(``python -m fedst.data.check``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

from fedst.data.base import DataError, SiteSource
from fedst.data.clips import ClipConfig, ClipDataset
from fedst.data.registry import open_site
from fedst.data.sites import DataConfig
from fedst.data.validation import REQUIRED_SPLITS, format_problems

log = logging.getLogger(__name__)


def site_roles(config: DataConfig, name: str) -> tuple[str, ...]:
    """The roles of site ``name`` in the data config: federation, out_of_federation, server."""
    roles = []
    if name in config.federation:
        roles.append("federation")
    if name in config.out_of_federation:
        roles.append("out_of_federation")
    if name == config.server:
        roles.append("server")
    return tuple(roles)


def required_splits(roles: Iterable[str]) -> list[str]:
    """The splits a site with these roles must have labelled frames in (sorted)."""
    return sorted({split for role in roles for split in REQUIRED_SPLITS[role]})


def split_problems(source: SiteSource, split: str, clip: ClipConfig) -> tuple[list[str], int]:
    """(problems, number of samples) of one split, validated in full through the cache."""
    try:
        dataset = ClipDataset(source, split, clip, None, validate=False)
    except (DataError, OSError) as err:
        return [str(err)], 0
    return dataset.problems(), len(dataset)


def validate_experiment_data(
    data: DataConfig, clip: ClipConfig, sites: Sequence[str] | None = None
) -> None:
    """Validate every configured site (federated, out-of-federation, server) for its role before
    anything trains; raise ONE DataError listing every site's problems."""
    names = sites or [
        *data.federation,
        *data.out_of_federation,
        *([data.server] if data.server else []),
    ]
    report: list[str] = []
    for name in dict.fromkeys(names):
        spec = data.sites[name]
        roles = site_roles(data, name)
        try:
            source = open_site(spec.backend, Path(spec.root), name, **spec.options)
        except (DataError, TypeError, OSError) as err:
            report.append(f"site {name} ({', '.join(roles)}): cannot open the site: {err}")
            continue
        for split in required_splits(roles):
            problems, samples = split_problems(source, split, clip)
            if problems:
                report.append(
                    format_problems(
                        f"site {name} ({', '.join(roles)}), split {split}: "
                        f"{len(problems)} problem(s)",
                        problems,
                    )
                )
            else:
                log.info("site %s split %s: %d samples validated", name, split, samples)
    if report:
        raise DataError(
            f"the data of {len(report)} site/split(s) cannot be used; nothing was trained. Fix "
            "these files (python -m fedst.data.check lists them too):\n" + "\n".join(report)
        )

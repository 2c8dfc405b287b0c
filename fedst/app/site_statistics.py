"""The statistics message at the start of a run: each site answers once with its data's numbers
(fedst/data/stats.py: frames and labelled frames per split, class pixel shares, colour mean and
std, image sizes; nothing else leaves the site), the server checks every number, writes
``site_stats.json`` into the run and logs a warning naming each site whose labels look written
in another encoding. Every engine runs it (in-process, Ray, deployment): it goes through
:class:`fedst.app.messaging.SiteGrid` like any round's message."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fedst.app import keys
from fedst.app.messaging import SiteGrid, site_of
from fedst.data.base import SiteSource
from fedst.data.stats import (
    DEFAULT_SAMPLE_FRAMES,
    encoding_warnings,
    site_statistics,
    statistics_from_record,
    statistics_to_record,
)
from fedst.federation import transport
from fedst.runs.layout import SITE_STATS_JSON
from fedst.storage import atomic_write_text

log = logging.getLogger("fedst.app.server_app")


def statistics_reply(message: Message, source: SiteSource, site: str) -> Message:
    """A site's answer: its statistics as flat numbers (record "metrics"), its name and the round
    it answers (record "site")."""
    config = message.content[keys.CONFIG]
    sample_frames = int(config.get(keys.STATS_SAMPLE_FRAMES, DEFAULT_SAMPLE_FRAMES))
    numbers = statistics_to_record(site_statistics(source, sample_frames))
    info = ConfigRecord({keys.SITE_NAME: site, keys.SITE_ROUND: int(config[keys.SERVER_ROUND])})
    return Message(
        RecordDict({keys.METRICS: MetricRecord(numbers), keys.SITE: info}), reply_to=message
    )


def collect_site_statistics(
    sites: SiteGrid,
    base_config: dict[str, Any],
    server_round: int,
    run_dir: Path,
    sample_frames: int = DEFAULT_SAMPLE_FRAMES,
) -> dict[str, Any]:
    """Ask every connected site for its statistics, check them, write ``site_stats.json`` and
    log the encoding warnings; returns what was written. A reply whose numbers fail a check is
    left out, listed under "refused" with the reason, and logged."""
    config = {
        **base_config,
        keys.SERVER_ROUND: server_round,
        keys.STATS_SAMPLE_FRAMES: sample_frames,
    }
    replies = sites.ask(
        keys.QUERY_SITE_STATS,
        transport.pack({}, "fp32"),
        config,
        server_round,
        "site statistics",
    )
    stats: dict[str, Any] = {}
    refused: dict[str, str] = {}
    for reply in replies.replies:
        site = site_of(reply)
        try:
            stats[site] = statistics_from_record(dict(reply.content[keys.METRICS]), site)
        except (KeyError, ValueError) as err:
            refused[site] = str(err)
            log.warning("site statistics refused: %s", err)
    warnings = encoding_warnings(stats)
    for line in warnings:
        log.warning("site statistics: %s", line)
    written = {
        "sample_frames": sample_frames,
        "sites": stats,
        "warnings": warnings,
        "refused": refused,
        "failed": {sites.sites_of.get(n, f"node {n}"): r for n, r in replies.failed.items()},
    }
    atomic_write_text(json.dumps(written, indent=2, sort_keys=True), run_dir / SITE_STATS_JSON)
    return written

"""The node config of a site started from a full local experiment (the in-process and Ray
engines, and a deployment on one machine, ``fedst.deploy local``): what a hospital's SuperNode
would be given with ``--node-config`` (its own data folder, state folder and hardware; no path
travels in a message)."""

from __future__ import annotations

import json
from typing import Any

from fedst.experiment import ExperimentConfig, SiteNodeConfig
from fedst.methods import Method, method_of


def site_node_config(
    cfg: ExperimentConfig,
    site: str,
    progress: bool = False,
    method: Method | None = None,
    **settings: Any,
) -> SiteNodeConfig:
    """The node config of ``site`` (a training party of the method) from a full local experiment
    (the site's own config): its own data and that of every other site it reads. ``method``:
    ``cfg``'s method where the caller holds it (None: built here)."""
    method = method_of(cfg) if method is None else method
    spec = cfg.data.sites.get(site)
    others = {
        name: {
            "root": cfg.data.sites[name].root,
            "backend": cfg.data.sites[name].backend,
            "options": cfg.data.sites[name].options,
        }
        for name in method.data_sites(site)
        if name != site
    }
    return SiteNodeConfig(
        site_name=site,
        data_path=spec.root if spec else None,
        backend=spec.backend if spec else None,
        site_options=json.dumps(spec.options if spec else {}, sort_keys=True),
        other_sites=json.dumps(others, sort_keys=True) if others else None,
        device=cfg.train.device,
        num_workers=cfg.train.num_workers,
        clip_cache=cfg.indicator.cache_dir,
        frame_cache=cfg.data.cache_dir,
        progress=progress,
        **settings,
    )

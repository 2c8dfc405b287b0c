"""What a site receives of the experiment, and what it adds from its own node: :func:`site_view`
drops every path and host-specific choice before the experiment travels in a train / evaluate
message, :func:`state_fingerprint` names what produces a site's private state, and
:class:`SiteNodeConfig` (Flower's node config, typed) completes a view with the site's own data
location, backend options and hardware."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedst.config import ConfigError, build
from fedst.experiment.config import ExperimentConfig
from fedst.experiment.roles import keys_of_roles, unfingerprinted_keys
from fedst.experiment.sections import IndicatorConfig, TrainConfig, check_num_workers
from fedst.schema.roles import FINGERPRINTED_ROLES, LEGACY_FINGERPRINTED_ROLES, NODE

SITE_VIEW_UNSET = ""
"""Placeholder of every data root in a site's view: paths never travel (each site has its own)."""


def site_view(cfg: ExperimentConfig) -> ExperimentConfig:
    """The experiment as every site receives it in a train/evaluate message.

    It keeps what defines training (method, network, train hyper-parameters, every site's name,
    backend and surgery type: the indicators of Table VII need the whole site list) and drops
    every path and host-specific choice: data roots and backend options of all sites, the common
    root, the procedural preset, and the fields of role ``node`` (fedst/schema/roles.py: device,
    DataLoader workers, the CLIP cache folder) at their defaults, and the frame cache folder
    (``data.cache_dir``). A site adds its own from its node config (:class:`SiteNodeConfig`).
    """
    sites = {
        name: dataclasses.replace(spec, root=SITE_VIEW_UNSET, options={})
        for name, spec in cfg.data.sites.items()
    }
    view = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, sites=sites, root=None, procedural=None, cache_dir=None),
    )
    for key in keys_of_roles(NODE):
        section, name = key.split(".")
        part = getattr(view, section)
        default = getattr(type(part)(), name)
        view = dataclasses.replace(view, **{section: dataclasses.replace(part, **{name: default})})
    return view


def state_fingerprint(view: ExperimentConfig) -> str:
    """Fingerprint of what produces a site's private state: the site view without the fields
    whose role leaves it (fedst/schema/roles.py: measure, server, cadence, execution,
    resource; a section left empty goes too, as ``fed`` did before it existed, so old runs keep
    their fingerprint)."""
    return _digest(_fingerprinted_values(view))


def legacy_state_fingerprints(view: ExperimentConfig) -> tuple[str, ...]:
    """The fingerprints that earlier runs recorded for the same configuration, so that a
    resumed old run is still recognised: with the ``resource`` fields (fingerprinted until
    issue 63), and also with ``train.compile`` a bool (before the execution fields existed);
    where ``train.clip_frame_loss_weight`` is 0 (what every run before it trained with), each of
    those also without that field. An old run resumed with other resource values than it
    recorded is not recognised: its fingerprint holds the old values."""
    with_resources = _fingerprinted_values(view, LEGACY_FINGERPRINTED_ROLES)
    compile_as_bool = copy.deepcopy(with_resources)
    compile_as_bool["train"]["compile"] = view.train.compile not in (False, "none")
    legacy = [with_resources, compile_as_bool]
    if view.train.clip_frame_loss_weight == 0:
        for values in list(legacy):
            before_the_field = copy.deepcopy(values)
            before_the_field["train"].pop("clip_frame_loss_weight")
            legacy.append(before_the_field)
    return tuple(_digest(values) for values in legacy)


def _fingerprinted_values(
    view: ExperimentConfig, fingerprinted: tuple[str, ...] = FINGERPRINTED_ROLES
) -> dict:
    values = json.loads(view.to_json())
    for key in unfingerprinted_keys(fingerprinted):
        section, name = key.split(".")
        values[section].pop(name)
        if not values[section]:
            values.pop(section)
    return values


def _digest(values: dict) -> str:
    return hashlib.sha1(json.dumps(values, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class SiteNodeConfig:
    """A site's own settings: Flower's ``node_config`` (``flower-supernode --node-config``), typed.

    Keys on the command line use dashes (``site-name="A" data-path="/data/a"``).
    """

    site_name: str | None = None
    """The site this node is (a name of data.federation). None: ``partition_id`` decides."""
    partition_id: int | None = None
    """Flower simulation's node index (Ray engine): site = data.federation[partition_id]."""
    data_path: str | None = None
    """The site's dataset root (its entry's ``root``). Required in deployment."""
    backend: str | None = None
    """Dataset backend of this site (default: the one named in the experiment)."""
    site_options: str = "{}"
    """Backend options of this site, as a JSON object (e.g. '{"site_dir": "hyst_yt"}')."""
    other_sites: str | None = None
    """Data of further sites this node reads, as a JSON object site -> {"root", "backend",
    "options"}: a party that trains or is scored on other sites' data (Method.data_sites, e.g.
    the upper bound's pool of every federated site). None (a hospital's own node): none."""
    state_dir: str | None = None
    """Folder of this site's private state; each run gets a sub-folder named by the server."""
    run_state_dir: str | None = None
    """Exact private-state folder for this run (the in-process engine: <run>/sites/<site>)."""
    device: str = TrainConfig.device
    """auto | cpu | cuda | cuda:N (this site's hardware)."""
    num_workers: int | str = TrainConfig.num_workers
    """DataLoader worker processes at this site (a number or "auto", as train.num_workers)."""
    clip_cache: str = IndicatorConfig.cache_dir
    """Folder of cached CLIP text embeddings at this site."""
    frame_cache: str | None = None
    """This site's preprocessed frame cache (``data.cache_dir``; python -m fedst.preprocess
    build). None: its loaders decode the frames."""
    progress: bool = False
    """Progress bars for local iterations and evaluation."""
    share_personal: bool = True
    """Send rho_k once at the end for the out-of-federation average (the only time private
    parameters leave the site; logged on both sides). False: this site is left out."""

    def __post_init__(self) -> None:
        check_num_workers("node_config num-workers", self.num_workers)

    @classmethod
    def from_node_config(cls, node_config: dict[str, Any]) -> SiteNodeConfig:
        names = {f.name.replace("_", "-"): f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in node_config.items() if k in names}
        return build(cls, {names[k]: v for k, v in known.items()}, "node_config")

    def to_node_config(self) -> dict[str, Any]:
        return {
            f.name.replace("_", "-"): getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }

    def to_cli(self) -> str:
        """The ``--node-config`` argument of ``flower-supernode`` (TOML values, space separated).

        Flower splits the argument with a regex that ends a double-quoted value at its first
        ``"`` (``parse_config_args`` in flwr/common/config.py), so a string holding double
        quotes (``site_options``' JSON) goes as a TOML literal string in single quotes."""
        return " ".join(
            f"{key}={_node_config_value(value)}" for key, value in self.to_node_config().items()
        )

    def private_state_dir(self, run_name: str, site: str) -> Path:
        if self.run_state_dir is not None:
            return Path(self.run_state_dir)
        if self.state_dir is None:
            raise ConfigError(
                f"site {site}: node config has neither state-dir nor run-state-dir; start the "
                f"site with a state folder (train_fed.py site={site} deploy.state_dir=<folder>)"
            )
        return Path(self.state_dir) / run_name

    def local_experiment(self, view: ExperimentConfig, site: str) -> ExperimentConfig:
        """The view completed with this node's own data location (and those of the other sites
        it reads), backend options and hardware."""
        try:
            others = json.loads(self.other_sites) if self.other_sites else {}
        except json.JSONDecodeError as err:
            raise ConfigError(f"node_config other-sites is not JSON: {err}") from err
        located = {}
        if site in view.data.sites:  # a data site (the upper bound's pool is none)
            if self.data_path is None:
                raise ConfigError(
                    f"site {site}: node config has no data-path; start the site with its data "
                    f"folder (train_fed.py site={site} data.sites.{site}.root=<folder>)"
                )
            try:
                options = json.loads(self.site_options)
            except json.JSONDecodeError as err:
                raise ConfigError(f"node_config site-options is not JSON: {err}") from err
            located[site] = {"root": self.data_path, "backend": self.backend, "options": options}
        located.update(others)
        unknown = sorted(set(located) - set(view.data.sites))
        if unknown:
            raise ConfigError(
                f"node of {site}: node_config other-sites names {unknown}, which are not sites "
                f"of the experiment ({sorted(view.data.sites)})"
            )
        sites = {
            name: dataclasses.replace(
                view.data.sites[name],
                root=where["root"],
                backend=where.get("backend") or view.data.sites[name].backend,
                options=where.get("options", {}),
            )
            for name, where in located.items()
        }
        return dataclasses.replace(
            view,
            data=dataclasses.replace(
                view.data, sites={**view.data.sites, **sites}, cache_dir=self.frame_cache
            ),
            train=dataclasses.replace(view.train, device=self.device, num_workers=self.num_workers),
            indicator=dataclasses.replace(view.indicator, cache_dir=self.clip_cache),
        )


def _node_config_value(value: Any) -> str:
    """One value of ``--node-config`` in TOML, as Flower's parser reads it (see ``to_cli``)."""
    if isinstance(value, str) and '"' in value:
        if "'" in value or "\n" in value:
            raise ConfigError(
                f"node config value {value!r} holds both quote kinds or a line break; "
                "Flower's --node-config cannot carry it"
            )
        return f"'{value}'"
    return json.dumps(value)

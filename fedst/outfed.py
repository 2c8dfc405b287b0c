"""Out-of-federation evaluation (paper Sec. IV-B2, Tables III and VIII).

The out-of-federation model is the sample-count-weighted average of all site models v_k =
gamma_g U rho_k, personalized parts included, so inference is a single forward pass. An unseen
site is prompted with its own text (e.g. "... surgery type is lobectomy"). On a binary site
(GraSP) every predicted part class counts as instrument.

The site models are read from the run directory (``sites/<site>/state_rNNNN.pt``): in simulation
the run directory holds them; in a deployment each hospital must choose to export its rho_k for
this step, which is the only time private parameters leave a site.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch

from fedst.config import ConfigError
from fedst.experiment import ExperimentConfig, site_state_dir
from fedst.federation.evaluation import EvaluationResult, evaluate_model
from fedst.federation.run_io import load_checkpoint
from fedst.federation.server import SERVER_CHECKPOINT
from fedst.federation.site import site_state_file
from fedst.federation.site_data import open_site_data
from fedst.methods import method_of
from fedst.metrics import format_score
from fedst.model.network import FedSTNet
from fedst.model.state import load_subset

log = logging.getLogger(__name__)


def _site_state(run_dir: Path, site: str, server_round: int) -> dict:
    path = site_state_file(site_state_dir(run_dir, site), server_round)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: site {site} has no saved state for round {server_round}"
        )
    return load_checkpoint(path)


def _server_checkpoint(run_dir: Path) -> dict:
    """The run's server checkpoint (read once per file version: it also holds the SERQ state)."""
    path = run_dir / SERVER_CHECKPOINT
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: {run_dir} is not a (started) FedST run directory"
        )
    checkpoint = _read_checkpoint(str(path), path.stat().st_mtime_ns)
    if checkpoint["round"] < 1:
        raise FileNotFoundError(
            f"no completed round in {run_dir}: the run stopped before round 1 finished, so no site "
            f"model exists yet; continue it with python train_fed.py resume={run_dir}"
        )
    return checkpoint


@functools.lru_cache(maxsize=1)
def _read_checkpoint(path: str, mtime_ns: int) -> dict:
    return load_checkpoint(Path(path))


def _site_model(
    cfg: ExperimentConfig, checkpoint: dict, personal: dict, device: torch.device
) -> FedSTNet:
    """gamma_g from the server checkpoint (when the method communicates) U the given rho."""
    model = method_of(cfg).build_model()
    if method_of(cfg).communicates:
        load_subset(model, {k: checkpoint["global_model"][k] for k in checkpoint["shared_keys"]})
    load_subset(model, personal)
    return model.to(device)


def personalized_model(
    cfg: ExperimentConfig, run_dir: Path, site: str, device: torch.device
) -> FedSTNet:
    """v_k = gamma_g U rho_k of a federated site (a training party of the method: the upper
    bound's is its pool, Method.party_of) after the run's last completed round."""
    checkpoint = _server_checkpoint(run_dir)
    personal = _site_state(run_dir, site, checkpoint["round"])["personal"]
    return _site_model(cfg, checkpoint, personal, device)


PERSONAL_EXPORT = "personal_export.json"
"""Written by the deployed server (fedst/app/server_app.py): which sites sent rho_k at the end."""


def averaged_sites(cfg: ExperimentConfig, run_dir: Path) -> tuple[list[str], list[str]]:
    """(sites whose rho_k enters the out-of-federation average, sites left out and why).

    In-process every federated site's state is in the run directory. In deployment only the
    sites that agreed to send rho_k at the end are averaged (personal_export.json).
    """
    parties = method_of(cfg).training_sites()  # the federated sites (upper bound: its pool)
    path = run_dir / PERSONAL_EXPORT
    if not path.exists():
        return list(parties), []
    export = json.loads(path.read_text())
    left_out = [f"{s} (declined)" for s in export["declined"]]
    left_out += [f"{s} (unreachable)" for s in export["unreachable"]]
    return [s for s in parties if s in export["shared"]], left_out


def averaged_model(cfg: ExperimentConfig, run_dir: Path, device: torch.device) -> FedSTNet:
    """Sample-count-weighted average of the federated site models (personal parts included)
    of every site that contributed its rho_k (:func:`averaged_sites`)."""
    checkpoint = _server_checkpoint(run_dir)
    sites, left_out = averaged_sites(cfg, run_dir)
    if left_out:
        log.warning("out-of-federation model leaves out %s", ", ".join(left_out))
    if not sites:
        raise FileNotFoundError(
            f"no site sent its personalized parameters ({', '.join(left_out)}): the "
            f"out-of-federation model cannot be built for {run_dir}"
        )
    states = [_site_state(run_dir, s, checkpoint["round"]) for s in sites]
    weights = [float(state["num_examples"]) for state in states]
    total = sum(weights)
    averaged = {
        key: sum(
            w / total * s["personal"][key].double() for w, s in zip(weights, states, strict=True)
        ).float()
        for key in states[0]["personal"]
    }
    log.info(
        "out-of-federation model: %d averaged personal tensors over %s (weights %s)",
        len(averaged),
        sites,
        weights,
    )
    return _site_model(cfg, checkpoint, averaged, device)


def evaluate_out_of_federation(
    cfg: ExperimentConfig,
    run_dir: Path,
    device: torch.device,
    sites: tuple[str, ...] | None = None,
    keep_examples: int = 0,
    progress: bool = False,
) -> dict[str, EvaluationResult]:
    """Score the averaged model on each out-of-federation site's test split, prompted as that site."""
    unknown = [s for s in sites or () if s not in cfg.data.sites]
    if unknown:
        raise ConfigError(
            f"sites={list(sites or ())}: {unknown} not configured in {run_dir}; known sites: "
            f"{sorted(cfg.data.sites)} (out of federation: {list(cfg.data.out_of_federation)})"
        )
    model = averaged_model(cfg, run_dir, device)
    indicators = method_of(cfg).indicators()
    results = {}
    for site in sites or cfg.data.out_of_federation:
        data = open_site_data(cfg, site, ("test",))
        results[site] = evaluate_model(
            model,
            data.test,
            indicators.get(site),
            device,
            max_frames=cfg.train.eval_max_frames,
            keep_examples=keep_examples,
            progress=progress,
        )
        log.info(
            "out-of-federation %s: Dice %s IoU %s",
            site,
            format_score(results[site].summary["dice"]),
            format_score(results[site].summary["iou"]),
        )
    return results

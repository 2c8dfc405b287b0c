"""A run directory as one object: :class:`Run` reads the config once, builds the method once, and
answers which model the run returns for a site, and for a site outside the federation.

    run = Run("runs/demo/fedst_s0")
    run.site_model("A", device)           # v_k after the last completed round
    run.site_model("A", device, round=40)   # v_k of validation round 40 (its selection snapshot)
    run.outfed_model(device)               # sum_k n_k / n v_k, the out-of-federation model

Which parts make v_k and their average: fedst/runs/returned.py. Where the files are:
fedst/runs/layout.py.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch

from fedst.experiment import ExperimentConfig, run_device
from fedst.methods import Method, method_of
from fedst.model.network import FedSTNet
from fedst.runs import layout
from fedst.runs.files import load_config
from fedst.runs.records import ServerCheckpoint, SiteState, TensorDict
from fedst.runs.returned import averaged_site_model, site_model
from fedst.storage import load_checkpoint

log = logging.getLogger(__name__)


class Run:
    """The run in ``run_dir``: its config (config.json, or ``cfg`` where a caller scores the run
    under other settings, e.g. another ``indicator.unseen``), its method and its models.

    ``round=None`` everywhere means the last completed round (the server checkpoint and the
    sites' ``state_rNNNN.pt``); a round N means validation round N's selection snapshots.
    """

    def __init__(
        self,
        run_dir: str | Path,
        cfg: ExperimentConfig | None = None,
        device_option: str = "train.device",
    ) -> None:
        self.dir = Path(run_dir)
        self.cfg = cfg if cfg is not None else load_config(self.dir)
        self.device_option = device_option
        """How the command reading the run names its device override (``--device`` for
        fedst.guard and fedst.report), named in a device error's fix."""
        self.method: Method = method_of(self.cfg)
        self._checkpoint: tuple[int, ServerCheckpoint] | None = None
        """(mtime_ns of server.pt, its record): read once per version of the file."""

    def __repr__(self) -> str:
        return f"Run({str(self.dir)!r})"

    @functools.cached_property
    def device(self) -> torch.device:
        """The torch device the run's models are scored on: fedst.experiment.run_device of its
        config (``train.device`` with ``train.require_gpu``; a command's override:
        fedst.experiment.with_device), resolved once per Run."""
        return run_device(self.cfg, self.device_option)

    def with_config(self, cfg: ExperimentConfig) -> Run:
        """The same run directory scored under ``cfg`` (the server checkpoint read is shared)."""
        other = Run(self.dir, cfg, self.device_option)
        other._checkpoint = self._checkpoint
        return other

    # -- files ------------------------------------------------------------------------------
    def path(self, name: str) -> Path:
        """A file of the run directory by its layout name (fedst/runs/layout.py)."""
        return self.dir / name

    def site_state_dir(self, site: str) -> Path:
        return layout.site_state_dir(self.dir, site)

    def snapshot_rounds(self) -> list[int]:
        """Validation rounds whose models model selection can rebuild, ascending."""
        return layout.snapshot_rounds(self.dir)

    # -- the server's side ------------------------------------------------------------------
    def server_checkpoint(self) -> ServerCheckpoint:
        """``checkpoints/server.pt`` after at least one completed round."""
        path = self.path(layout.SERVER_CHECKPOINT)
        if not path.exists():
            raise FileNotFoundError(
                f"{path} is missing: {self.dir} is not a (started) FedST run directory"
            )
        version = path.stat().st_mtime_ns
        if self._checkpoint is None or self._checkpoint[0] != version:
            self._checkpoint = (version, ServerCheckpoint.from_dict(load_checkpoint(path)))
        checkpoint = self._checkpoint[1]
        if checkpoint.round < 1:
            raise FileNotFoundError(
                f"no completed round in {self.dir}: the run stopped before round 1 finished, so "
                f"no site model exists yet; continue it with python train_fed.py resume={self.dir}"
            )
        return checkpoint

    @property
    def last_round(self) -> int:
        """The last completed round (of the server checkpoint)."""
        return self.server_checkpoint().round

    def global_shared(self, round: int | None = None) -> TensorDict:
        """gamma_g after ``round`` as the returned models read it: empty when the method sends
        nothing or its sites return their own models (v_k = gamma_k U rho_k)."""
        if not self.method.communicates or self.method.returns_own_model:
            return {}
        if round is None:
            return self.server_checkpoint().global_shared()
        path = layout.shared_snapshot_path(self.dir, round)
        return _read_snapshot(path, f"gamma_g of round {round}")["shared"]

    # -- the sites' side --------------------------------------------------------------------
    def site_state(self, site: str, round: int | None = None) -> SiteState:
        """What the run keeps of ``site``'s model after ``round`` (a training party of the method:
        the upper bound's is its pool, Method.party_of)."""
        if round is None:
            server_round = self.last_round
            path = layout.site_state_file(self.site_state_dir(site), server_round)
            if not path.exists():
                raise FileNotFoundError(
                    f"{path} is missing: site {site} has no saved state for round {server_round}"
                )
            return SiteState.from_dict(load_checkpoint(path), site)
        path = layout.personal_snapshot_path(self.site_state_dir(site), round)
        return SiteState.from_dict(
            _read_snapshot(path, f"site {site}'s rho_k of round {round}"), site
        )

    def site_model(self, site: str, device: torch.device, round: int | None = None) -> FedSTNet:
        """v_k: the model ``site`` returns after ``round``, gamma_k U rho_k or gamma_g U rho_k by
        method.returned_model (fedst/runs/returned.py)."""
        state = self.site_state(site, round)
        return site_model(self.method, state, self.global_shared(round), device)

    def averaged_sites(self) -> tuple[list[str], list[str]]:
        """(sites whose rho_k enters the out-of-federation average, sites left out and why).

        In-process every training party's state is in the run directory (the upper bound: its
        pool). In deployment only the sites that agreed to send rho_k at the end are averaged
        (personal_export.json).
        """
        parties = self.method.training_sites()
        path = self.path(layout.PERSONAL_EXPORT)
        if not path.exists():
            return list(parties), []
        export = json.loads(path.read_text())
        left_out = [f"{s} (declined)" for s in export["declined"]]
        left_out += [f"{s} (unreachable)" for s in export["unreachable"]]
        missed = export.get("missed_last_round", [])
        left_out += [f"{s} (no gamma_k of the last round)" for s in missed]
        return [s for s in parties if s in export["shared"]], left_out

    def outfed_model(self, device: torch.device, round: int | None = None) -> FedSTNet:
        """The out-of-federation model: sum_k n_k / n v_k over the sites' returned models,
        personal parts included, under the run's ``indicator.unseen`` rule.

        After the last round it averages :meth:`averaged_sites`; at validation round N, every
        federated site's snapshot (``data.federation``)."""
        if round is not None:
            states = [self.site_state(site, round) for site in self.cfg.data.federation]
            return averaged_site_model(self.method, states, self.global_shared(round), device)
        sites, left_out = self.averaged_sites()
        if left_out:
            log.warning("out-of-federation model leaves out %s", ", ".join(left_out))
        if not sites:
            raise FileNotFoundError(
                f"no site sent its personalized parameters ({', '.join(left_out)}): the "
                f"out-of-federation model cannot be built for {self.dir}"
            )
        states = [self.site_state(site) for site in sites]
        log.info(
            "out-of-federation model: the %s models of %s averaged with weights %s; unseen-site "
            "indicator rule: %s",
            self.cfg.method.returned_model,
            sites,
            [state.num_examples for state in states],
            self.cfg.unseen_indicator_rule(),
        )
        return averaged_site_model(self.method, states, self.global_shared(), device)


def _read_snapshot(path: Path, what: str) -> dict:
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: {what} was not kept. Only rounds scored on validation "
            f"(train.val_every) keep their models; choose one of those rounds"
        )
    return load_checkpoint(path)

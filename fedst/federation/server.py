"""The server's side of Algorithm 1: the global model v_g, the server step, and checkpoints.

Aggregation itself (FedAvg's weighted mean or FedMedian) is done by Flower's strategies in the
ServerApp; this class receives the aggregated gamma, applies the method's server step (SERQ for
FedST, nothing otherwise) and hands out what the sites receive next round. It never sees a site's
private parameters rho_k.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from fedst.data.clips import BatchStream, ClipDataset
from fedst.experiment import ExperimentConfig, site_state_dir
from fedst.federation.components import (
    build_indicators,
    build_loss,
    build_model,
    load_subset,
    partition_of,
    seed_everything,
    state_subset,
)
from fedst.federation.run_io import (
    CheckpointError,
    atomic_torch_save,
    load_checkpoint,
    remove_stale_tmp,
)
from fedst.federation.serq import Serq, SerqRoundStats
from fedst.federation.site import site_state_file

log = logging.getLogger(__name__)

SERVER_CHECKPOINT = "checkpoints/server.pt"
SERVER_PREVIOUS = "checkpoints/server.prev.pt"
"""The checkpoint of the round before SERVER_CHECKPOINT's: the fallback when the latest is damaged."""


def load_server_checkpoint(
    run_dir: Path, map_location: object = "cpu", sites: tuple[str, ...] = ()
) -> dict:
    """The newest usable server checkpoint: ``server.pt``, else ``server.prev.pt`` (logged).

    A checkpoint of round N is usable when it reads and, for every site in ``sites`` whose state
    folder is in the run directory (simulation), ``sites/<site>/state_rNNNN.pt`` of round N reads
    too (sites keep two rounds, so round N-1 is the fallback when round N's state is damaged).
    """
    problems = []
    for name in (SERVER_CHECKPOINT, SERVER_PREVIOUS):
        path = run_dir / name
        if not path.exists():
            continue
        try:
            state = load_checkpoint(path, map_location)
            for site in sites:
                state_dir = site_state_dir(run_dir, site)
                if state["round"] >= 1 and state_dir.is_dir():
                    load_checkpoint(site_state_file(state_dir, state["round"]))
        except (CheckpointError, FileNotFoundError) as err:
            problems.append(str(err))
            log.warning("cannot resume from %s: %s", path, err)
            continue
        if problems:
            log.warning("falling back to %s (round %d)", path, state["round"])
        return state
    raise CheckpointError(
        f"no usable server checkpoint in {run_dir / 'checkpoints'}: "
        + ("; ".join(problems) or "none written")
        + ". Start a new run."
    )


class FederationServer:
    """Holds v_g (shared gamma_g plus the server's own rho_g) and, for FedST, the SERQ state."""

    def __init__(
        self, cfg: ExperimentConfig, run_dir: Path, device: torch.device, progress: bool = False
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.device = device
        self.progress = progress
        self.global_model = build_model(cfg).to(device)
        self.partition = partition_of(self.global_model, cfg)
        self.completed_round = 0
        for folder in (run_dir / "checkpoints", run_dir):  # left by a process killed mid-write
            remove_stale_tmp(folder)
        self.serq: Serq | None = None
        if cfg.method.serq:
            self.serq = self._build_serq()

    def _build_serq(self) -> Serq:
        cfg = self.cfg
        if cfg.data.server is None:
            raise ValueError("method.serq=true needs a synthetic server set: set data.server")
        source = cfg.data.open(cfg.data.server)
        clip = cfg.clip_config()
        dataset = ClipDataset(source, "train", clip, cfg.augment)
        stream = BatchStream(
            dataset, batch_size=cfg.serq.batch_size, seed=cfg.seed * 1000 + 999, num_workers=0
        )
        return Serq(
            cfg.serq,
            synthetic_model=copy.deepcopy(self.global_model),
            stream=stream,
            reference=ClipDataset(source, "train", clip, None, validate=False),
            indicator=build_indicators(cfg).get(cfg.data.server),
            loss_fn=build_loss(cfg),
            device=self.device,
        )

    # -- round 0 --------------------------------------------------------------------------------
    def initialize(self) -> float | None:
        """Algorithm 1 line 3: with SERQ, pre-train v_pre^0 on synthetic data and set v_g^0 = v_pre^0.

        Returns the pre-training loss (None without SERQ).
        """
        if self.serq is None:
            return None
        seed_everything(self.cfg.seed, 0x5E12, 0)
        loss = self.serq.pretrain(self.cfg.serq.pretrain_iters, progress=self.progress)
        self.global_model.load_state_dict(self.serq.synthetic_model.state_dict())
        log.info(
            "SERQ pre-training: %d iterations, final loss %.4f", self.cfg.serq.pretrain_iters, loss
        )
        return loss

    def initial_payload(self) -> dict[str, torch.Tensor]:
        """What every site loads before round 1: the full initial model (shared and personal parts
        start from v_g^0 = v_pre^0). This is the server's own model; no site's rho ever travels."""
        return state_subset(self.global_model, [*self.partition.shared, *self.partition.personal])

    def shared_payload(self) -> dict[str, torch.Tensor]:
        """gamma_g: what the sites receive from round 2 on (Algorithm 1, line 12)."""
        return state_subset(self.global_model, self.partition.shared)

    # -- Algorithm 1, lines 8-12 ----------------------------------------------------------------
    def server_step(
        self, aggregated: dict[str, torch.Tensor], server_round: int
    ) -> SerqRoundStats | None:
        """v_g^{t+1} := gamma_g^{t+1} U rho_g^t, then SERQ-EQ and SERQ-SC when the method uses them."""
        load_subset(self.global_model, aggregated)
        if self.serq is None:
            return None
        seed_everything(self.cfg.seed, 0x5E12, server_round)
        return self.serq.step(self.global_model)

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, server_round: int, extra: dict | None = None) -> None:
        self.completed_round = server_round
        atomic_torch_save(
            {
                "round": server_round,
                "global_model": self.global_model.state_dict(),
                "shared_keys": list(self.partition.shared),
                "serq": None if self.serq is None else self.serq.state_dict(),
                "extra": extra or {},
            },
            self.run_dir / SERVER_CHECKPOINT,
            keep_previous=self.run_dir / SERVER_PREVIOUS,
        )

    def load(self) -> dict:
        """Resume from the newest usable checkpoint (see :func:`load_server_checkpoint`)."""
        state = load_server_checkpoint(self.run_dir, self.device, self.cfg.data.federation)
        self.global_model.load_state_dict(state["global_model"])
        if self.serq is not None:
            self.serq.load_state_dict(state["serq"], self.global_model)
        self.completed_round = state["round"]
        return state["extra"]

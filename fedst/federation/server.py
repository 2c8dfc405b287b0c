"""The server's side of Algorithm 1: the global model v_g, the server step, and checkpoints.

Aggregation itself (FedAvg's weighted mean or FedMedian) is done by the method in the ServerApp;
this class receives the aggregated gamma, applies the method's own server step
(``Method.server_step``: SERQ for FedST, none otherwise) and hands out what the sites receive
next round. It never sees a site's private parameters rho_k, and knows no method by name.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from fedst.accel import configure_device, fused_optimizer_options, resolve_precision
from fedst.experiment import ExperimentConfig
from fedst.methods import method_of
from fedst.methods.pretraining import PretrainResult, pretrain_on_synthetic, synthetic_stream
from fedst.methods.server_step import ServerContext, StepFiles
from fedst.model.state import load_subset, state_subset
from fedst.runs.layout import SERVER_CHECKPOINT, SERVER_PREVIOUS, site_state_dir, site_state_file
from fedst.seeding import seed_everything
from fedst.storage import CheckpointError, atomic_torch_save, load_checkpoint, remove_stale_tmp

log = logging.getLogger(__name__)

SERVER_STEP_KEY = "server_step"
"""In the method's entry of the server checkpoint: the state of the method's server step."""


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
    """Holds v_g (shared gamma_g plus the server's own rho_g) and the method's server step."""

    def __init__(
        self, cfg: ExperimentConfig, run_dir: Path, device: torch.device, progress: bool = False
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.device = device
        self.progress = progress
        self.method = method_of(cfg)
        configure_device(
            device,
            tf32=cfg.train.tf32,
            cudnn_benchmark=cfg.train.cudnn_benchmark,
            deterministic=cfg.train.deterministic,
        )
        self.precision = resolve_precision(cfg.train.amp_dtype, device)
        """Mixed precision of the server's training (synthetic pre-training, SERQ)."""
        self.global_model = self.method.build_model().to(device)
        self.partition = self.method.partition(self.global_model)
        self.completed_round = 0
        self._saved_round: int | None = None
        """Round of the checkpoint on disk (None: none written or loaded by this process)."""
        self._previous_saved_round: int | None = None
        """Round of the checkpoint before it (``server.prev.pt``; None: none)."""
        for folder in (run_dir / "checkpoints", run_dir):  # left by a process killed mid-write
            remove_stale_tmp(folder)
        self.step = self.method.server_step(
            ServerContext(self.global_model, device, self.precision, run_dir, progress)
        )
        """The method's own step after aggregation (None: the aggregate is taken as it is)."""

    # -- round 0 --------------------------------------------------------------------------------
    def initialize(self) -> PretrainResult | None:
        """Algorithm 1 line 3: v_g^0 = v_pre^0, the network pre-trained on the synthetic set
        (every method, fedst/methods/pretraining.py; with SERQ v_pre lives on in SERQ).

        Returns the pre-training's loss and cost (None without pre-training).
        """
        if not self.method.config.synthetic_pretraining:
            return None
        iters = self.cfg.pretraining.iters
        seed_everything(self.cfg.seed, 0x5E12, 0)
        result = self.step.pretrain(iters) if self.step is not None else None
        if result is None:
            stream, _ = synthetic_stream(
                self.cfg, self.method.name, self.device, self.cfg.pretraining.batch_size
            )
            try:
                result = pretrain_on_synthetic(
                    self.global_model,
                    torch.optim.Adam(
                        self.global_model.parameters(),
                        lr=self.cfg.pretraining.lr,
                        **fused_optimizer_options(self.device),
                    ),
                    stream,
                    self.method.indicators().get(self.cfg.data.server),
                    self.method.segmentation_loss(),
                    iters,
                    self.device,
                    progress=self.progress,
                    precision=self.precision,
                    scaler=self.precision.grad_scaler(),
                )
            finally:
                stream.close()  # its loader workers (train.num_workers) are not needed again
        log.info("synthetic pre-training: %d iterations, final loss %.4f", iters, result.loss)
        return result

    def initial_payload(self) -> dict[str, torch.Tensor]:
        """What every site loads before round 1: the full initial model (shared and personal parts
        start from v_g^0 = v_pre^0). This is the server's own model; no site's rho ever travels."""
        return state_subset(self.global_model, [*self.partition.shared, *self.partition.personal])

    def shared_payload(self) -> dict[str, torch.Tensor]:
        """gamma_g: what the sites receive from round 2 on (Algorithm 1, line 12)."""
        return state_subset(self.global_model, self.partition.shared)

    # -- Algorithm 1, lines 8-12 ----------------------------------------------------------------
    def server_step(self, aggregated: dict[str, torch.Tensor], server_round: int) -> dict:
        """v_g^{t+1} := gamma_g^{t+1} U rho_g^t, then the method's own step (SERQ-EQ and
        SERQ-SC for FedST).

        Returns what the log records: the step's own scalars (SERQ's SerqRoundStats) and how far
        it moved gamma_g against the aggregation: ``aggregation_change`` = ||gamma_agg -
        gamma_g^t||_2, ``serq_change`` = ||gamma_g^{t+1} - gamma_agg||_2 and their ratio
        ``server_pull`` (shared tensors only; the names of the logs written before the hook)."""
        if self.step is None:
            load_subset(self.global_model, aggregated)
            return {}
        before = self.shared_payload()
        load_subset(self.global_model, aggregated)
        seed_everything(self.cfg.seed, 0x5E12, server_round)
        stats = self.step.step(self.global_model, server_round)
        aggregation_change = _distance(aggregated, before)
        serq_change = _distance(self.shared_payload(), aggregated)
        return {
            **stats,
            "aggregation_change": aggregation_change,
            "serq_change": serq_change,
            "server_pull": serq_change / aggregation_change if aggregation_change else None,
        }

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_due(self, server_round: int) -> bool:
        """Whether ``server_round`` ends with a checkpoint: every ``train.checkpoint_every``
        rounds and at the last round."""
        every, last = self.cfg.train.checkpoint_every, self.cfg.train.rounds
        return server_round % every == 0 or server_round >= last

    def checkpoint_rounds(self) -> list[int]:
        """Rounds of the two checkpoints on disk (latest last): the rounds a resumed run can
        restart after, so the sites keep their states of these rounds."""
        return [r for r in (self._previous_saved_round, self._saved_round) if r is not None]

    def end_round(self, server_round: int, extra: dict | None = None) -> dict:
        """Close ``server_round``: :meth:`save` when a checkpoint is due, else only count it
        (the log then records zero checkpoint time and bytes)."""
        if self.checkpoint_due(server_round):
            return self.save(server_round, extra)
        self.completed_round = server_round
        return {
            "checkpoint_seconds": 0.0,
            "checkpoint_bytes": 0,
            "server_checkpoint_bytes": 0,
            "bank_bytes_written": 0,
            "bank_entries_written": 0,
        }

    def save(self, server_round: int, extra: dict | None = None) -> dict:
        """Checkpoint the completed ``server_round``: the server step's own files first (SERQ's
        changed bank entries, fedst/methods/feature_bank.py), then ``server.pt`` (the previous
        one kept as ``server.prev.pt``), then the step's files neither checkpoint reads are pruned.

        Returns what the log records: ``checkpoint_seconds`` (wall time of the writes),
        ``checkpoint_bytes`` (``server.pt`` plus the bank entries written), and its two parts
        ``server_checkpoint_bytes`` and ``bank_bytes_written`` (``bank_entries_written`` files)."""
        started = time.perf_counter()
        self.completed_round = server_round
        bank = self.step.save_files(server_round) if self.step is not None else StepFiles()
        path = self.run_dir / SERVER_CHECKPOINT
        atomic_torch_save(
            {
                "round": server_round,
                "previous_round": self._saved_round,
                "global_model": self.global_model.state_dict(),
                "shared_keys": list(self.partition.shared),
                "method": self._method_state(),
                "extra": extra or {},
            },
            path,
            keep_previous=self.run_dir / SERVER_PREVIOUS,
        )
        if self.step is not None:
            self.step.prune_files(server_round, self._saved_round)
        if self._saved_round != server_round:
            self._previous_saved_round = self._saved_round
        self._saved_round = server_round
        server_pt_bytes = path.stat().st_size
        return {
            "checkpoint_seconds": time.perf_counter() - started,
            "checkpoint_bytes": server_pt_bytes + bank.bytes,
            "server_checkpoint_bytes": server_pt_bytes,
            "bank_bytes_written": bank.bytes,
            "bank_entries_written": bank.files,
        }

    def close(self) -> None:
        """Release what the run no longer needs once it is over (SERQ's scratch bank file)."""
        if self.step is not None:
            self.step.close()

    def _method_state(self) -> dict:
        """The method's entry of the checkpoint: its own state and its server step's."""
        state = self.method.state_dict()
        if self.step is not None:
            state = {**state, SERVER_STEP_KEY: self.step.state_dict()}
        return state

    def load(self) -> dict:
        """Resume from the newest usable checkpoint (see :func:`load_server_checkpoint`)."""
        state = load_server_checkpoint(self.run_dir, self.device, self.method.training_sites())
        self.global_model.load_state_dict(state["global_model"])
        method_state = dict(state.get("method", {}))
        step_state = method_state.pop(SERVER_STEP_KEY, None)
        if step_state is None:  # a checkpoint written before the hook kept SERQ's state apart
            step_state = state.get("serq")
        if self.step is not None:
            self.step.load_state_dict(step_state, state["round"])
        self.method.load_state_dict(method_state)
        self.completed_round = self._saved_round = state["round"]
        self._previous_saved_round = state.get("previous_round")
        return state["extra"]


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b||_2 over the float tensors of ``a`` (keys of a shared payload), in fp64."""
    total = sum(
        (value.double() - b[key].double().to(value.device)).pow(2).sum().item()
        for key, value in a.items()
        if value.is_floating_point()
    )
    return float(total) ** 0.5

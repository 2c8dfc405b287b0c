"""The server's side of Algorithm 1: the global model v_g, the server step, and checkpoints.

Aggregation itself (FedAvg's weighted mean or FedMedian) is done by Flower's strategies in the
ServerApp; this class receives the aggregated gamma, applies the method's server step (SERQ for
FedST, nothing otherwise) and hands out what the sites receive next round. It never sees a site's
private parameters rho_k.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from pathlib import Path

import torch

from fedst.accel import configure_device, fused_optimizer_options, resolve_precision
from fedst.config import ConfigError
from fedst.data.clips import BatchStream, ClipDataset
from fedst.experiment import ExperimentConfig
from fedst.federation.feature_bank import (
    FEATURE_BANK_DIR,
    SERQ_BANK_SCRATCH,
    BankWrite,
    DiskFeatureBank,
    FeatureBankStore,
)
from fedst.federation.pretraining import pretrain_on_synthetic
from fedst.federation.serq import Serq
from fedst.methods import method_of
from fedst.model.state import load_subset, state_subset
from fedst.runs.files import (
    CheckpointError,
    atomic_torch_save,
    load_checkpoint,
    remove_stale_tmp,
)
from fedst.runs.layout import SERVER_CHECKPOINT, SERVER_PREVIOUS, site_state_dir, site_state_file
from fedst.seeding import seed_everything

log = logging.getLogger(__name__)


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
        self.bank_store = FeatureBankStore(run_dir / FEATURE_BANK_DIR)
        for folder in (run_dir / "checkpoints", run_dir):  # left by a process killed mid-write
            remove_stale_tmp(folder)
        self.serq: Serq | None = None
        if self.method.uses_serq:
            self.serq = self._build_serq()

    def _synthetic_stream(self) -> tuple[BatchStream, ClipDataset]:
        """The server's synthetic set: a seeded augmented batch stream and the un-augmented set.

        Clips of one frame: the server's passes (synthetic pre-training, SERQ) run the network
        with ``use_temporal=False``, which reads only a clip's current frame, so earlier frames
        would be decoded, augmented and copied for nothing."""
        cfg = self.cfg
        if cfg.data.server is None:
            raise ConfigError(
                f"method {self.method.name} starts from synthetic pre-training (and SERQ, if on) "
                f"but data.server is null: set data.server to the synthetic set, or "
                f"method.synthetic_pretraining=false (and method.serq=false)"
            )
        source = cfg.data.open(cfg.data.server)
        clip = dataclasses.replace(cfg.clip_config(), num_frames=1)
        dataset = ClipDataset(source, "train", clip, cfg.augment)
        stream = BatchStream(
            dataset,
            batch_size=cfg.serq.batch_size,
            seed=cfg.seed * 1000 + 999,
            num_workers=cfg.train.num_workers,
            device=self.device,
            num_classes=cfg.network.num_classes,
        )
        return stream, ClipDataset(source, "train", clip, None, validate=False)

    def _build_serq(self) -> Serq:
        stream, reference = self._synthetic_stream()
        return Serq(
            self.cfg.serq,
            synthetic_model=copy.deepcopy(self.global_model),
            stream=stream,
            reference=reference,
            indicator=self.method.indicators().get(self.cfg.data.server),
            loss_fn=self.method.segmentation_loss(),
            device=self.device,
            feature_stage=self.serq_feature_stage(),
            precision=self.precision,
            feature_bank=(
                DiskFeatureBank(self.run_dir / SERQ_BANK_SCRATCH)
                if self.cfg.serq.bank_storage == "disk"
                else {}
            ),
            compile_mode=self.cfg.train.compile,
            channels_last=self.cfg.train.channels_last,
        )

    def serq_feature_stage(self) -> int:
        """serq.feature_stage, or F_ts's stage: the first the temporal module reads."""
        configured = self.cfg.serq.feature_stage
        return self.method.network_config().temporal_stages[0] if configured is None else configured

    # -- round 0 --------------------------------------------------------------------------------
    def initialize(self) -> float | None:
        """Algorithm 1 line 3: v_g^0 = v_pre^0, the network pre-trained on the synthetic set
        (every method, fedst/federation/pretraining.py; with SERQ v_pre lives on in SERQ).

        Returns the pre-training loss (None without pre-training).
        """
        if not self.method.config.synthetic_pretraining:
            return None
        iters = self.cfg.serq.pretrain_iters
        seed_everything(self.cfg.seed, 0x5E12, 0)
        if self.serq is not None:
            loss = self.serq.pretrain(iters, progress=self.progress)
            self.global_model.load_state_dict(self.serq.synthetic_model.state_dict())
        else:
            stream, _ = self._synthetic_stream()
            try:
                loss = pretrain_on_synthetic(
                    self.global_model,
                    torch.optim.Adam(
                        self.global_model.parameters(),
                        lr=self.cfg.serq.lr,
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
        log.info("synthetic pre-training: %d iterations, final loss %.4f", iters, loss)
        return loss

    def initial_payload(self) -> dict[str, torch.Tensor]:
        """What every site loads before round 1: the full initial model (shared and personal parts
        start from v_g^0 = v_pre^0). This is the server's own model; no site's rho ever travels."""
        return state_subset(self.global_model, [*self.partition.shared, *self.partition.personal])

    def shared_payload(self) -> dict[str, torch.Tensor]:
        """gamma_g: what the sites receive from round 2 on (Algorithm 1, line 12)."""
        return state_subset(self.global_model, self.partition.shared)

    # -- Algorithm 1, lines 8-12 ----------------------------------------------------------------
    def server_step(self, aggregated: dict[str, torch.Tensor], server_round: int) -> dict:
        """v_g^{t+1} := gamma_g^{t+1} U rho_g^t, then SERQ-EQ and SERQ-SC when the method uses them.

        Returns what the log records: SERQ's round (SerqRoundStats) and, with SERQ, how far it
        moved gamma_g against the aggregation: ``aggregation_change`` = ||gamma_agg -
        gamma_g^t||_2, ``serq_change`` = ||gamma_g^{t+1} - gamma_agg||_2 and their ratio
        ``server_pull`` (shared tensors only)."""
        if self.serq is None:
            load_subset(self.global_model, aggregated)
            return {}
        before = self.shared_payload()
        load_subset(self.global_model, aggregated)
        seed_everything(self.cfg.seed, 0x5E12, server_round)
        stats = self.serq.step(self.global_model)
        aggregation_change = _distance(aggregated, before)
        serq_change = _distance(self.shared_payload(), aggregated)
        return {
            **vars(stats),
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
        """Checkpoint the completed ``server_round``: SERQ's changed bank entries first
        (fedst/federation/feature_bank.py), then ``server.pt`` (the previous one kept as
        ``server.prev.pt``), then bank files neither checkpoint reads are pruned.

        Returns what the log records: ``checkpoint_seconds`` (wall time of the writes),
        ``checkpoint_bytes`` (``server.pt`` plus the bank entries written), and its two parts
        ``server_checkpoint_bytes`` and ``bank_bytes_written`` (``bank_entries_written`` files)."""
        started = time.perf_counter()
        self.completed_round = server_round
        bank = BankWrite(0, 0)
        if self.serq is not None:
            bank = self.serq.save_feature_bank(self.bank_store, server_round)
        path = self.run_dir / SERVER_CHECKPOINT
        atomic_torch_save(
            {
                "round": server_round,
                "previous_round": self._saved_round,
                "global_model": self.global_model.state_dict(),
                "shared_keys": list(self.partition.shared),
                "serq": None if self.serq is None else self.serq.state_dict(),
                "method": self.method.state_dict(),
                "extra": extra or {},
            },
            path,
            keep_previous=self.run_dir / SERVER_PREVIOUS,
        )
        if self.serq is not None:
            self.bank_store.prune(server_round, self._saved_round)
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
        """Release what the run no longer needs once it is over: SERQ's scratch bank file."""
        if self.serq is not None and isinstance(self.serq.feature_bank, DiskFeatureBank):
            self.serq.feature_bank.close()

    def load(self) -> dict:
        """Resume from the newest usable checkpoint (see :func:`load_server_checkpoint`)."""
        state = load_server_checkpoint(self.run_dir, self.device, self.method.training_sites())
        self.global_model.load_state_dict(state["global_model"])
        if self.serq is not None:
            self.serq.load_state_dict(state["serq"], self.global_model)
            if "feature_bank" not in state["serq"]:
                self.serq.load_feature_bank(self.bank_store, state["round"])
        self.method.load_state_dict(state.get("method", {}))
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

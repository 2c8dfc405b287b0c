"""One site's side of Algorithm 1 (lines 5-7): RSC local training, then only gamma leaves the site.

A :class:`Site` owns the full local model v_k = gamma_k U rho_k, its AdamW optimizer and its batch
stream. Each round it loads the received shared parameters gamma, trains E local iterations on
4-frame clips with L_seg (Eq. 9) -- the private rho_k by Eq. 5 and gamma by Eq. 6 -- and returns
the shared subset. Everything private (rho_k, optimizer moments, data order) is saved to the
site's own folder after every round, so a restarted site or a resumed run continues exactly.

Nothing here imports Flower: the ClientApp (fedst/app/client_app.py) is glue around this class.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fedst.accel import (
    CompiledStep,
    LossLog,
    bulk_to_host,
    clips_channels_last,
    configure_device,
    device_facts,
    first_non_finite,
    fused_optimizer_options,
    match_parameter_layouts,
    optimizer_step,
    resolve_precision,
    standalone,
    use_channels_last,
)
from fedst.config import ConfigError, to_dict
from fedst.data.clips import BatchStream, ClipDataset, FrameLoaders, current_frame_masks
from fedst.data.splits import validation_dataset
from fedst.experiment import (
    ExperimentConfig,
    legacy_state_fingerprints,
    site_view,
    state_fingerprint,
)
from fedst.federation.snapshots import save_personal_snapshot
from fedst.federation.state_writer import wait_for_state_writes, write_in_background
from fedst.methods import LocalPhase, method_of
from fedst.methods.base import BatchLoss
from fedst.methods.optimizer import lr_factor, param_groups, set_lr_factor
from fedst.methods.reply_keys import TRAIN_LOSS
from fedst.model.network import FedSTNet
from fedst.model.state import load_subset, state_subset
from fedst.progress import progress_bar
from fedst.runs.layout import STATE_FINGERPRINT, saved_rounds, site_state_file
from fedst.scoring.evaluation import EvaluationResult, evaluate_model
from fedst.scoring.site_data import open_party_data
from fedst.seeding import seed_everything
from fedst.storage import CheckpointError, atomic_torch_save, load_checkpoint, remove_stale_tmp

log = logging.getLogger(__name__)


"""In a site's state folder: the fingerprint (and config) of the run that wrote the states."""


class StateMismatchError(ConfigError):
    """A site's state folder was written by a run with another configuration."""


def claim_state_dir(state_dir: Path, site: str, cfg: ExperimentConfig) -> str:
    """Record (first use) or check (later uses) which configuration owns ``state_dir``.

    Resuming with a different configuration would silently mix private states, so it stops with
    the differing keys. Evaluation settings, paths and hardware are not part of the fingerprint.
    """
    view = site_view(cfg)
    fingerprint = state_fingerprint(view)
    path = state_dir / STATE_FINGERPRINT
    if path.exists():
        recorded = json.loads(path.read_text())
        if recorded["fingerprint"] in legacy_state_fingerprints(view):
            return fingerprint  # an earlier rule recorded the same config
        if recorded["fingerprint"] != fingerprint:
            differences = _differences(recorded["config"], to_dict(view))
            raise StateMismatchError(
                f"site {site}: {state_dir} holds private state of a run with config fingerprint "
                f"{recorded['fingerprint']}, this run's is {fingerprint} (differs in: "
                f"{', '.join(differences[:6]) or 'evaluation-independent keys'}). Resume with the "
                f"original config, or give this run a new state folder."
            )
        return fingerprint
    state_dir.mkdir(parents=True, exist_ok=True)
    record = {"fingerprint": fingerprint, "site": site, "config": to_dict(view)}
    path.write_text(json.dumps(record, indent=1, sort_keys=True))
    return fingerprint


def _differences(old: object, new: object, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new))
        return [d for k in keys for d in _differences(old.get(k), new.get(k), f"{prefix}{k}.")]
    return [] if old == new else [f"{prefix[:-1]}={old!r}->{new!r}"]


class NonFiniteLossError(RuntimeError):
    """A training loss became NaN or infinite; the run stops and keeps its last good checkpoint."""


class NonFiniteUpdateError(RuntimeError):
    """A shared parameter became NaN or infinite after local training; nothing is sent or saved."""


@dataclass
class LocalRoundResult:
    shared: dict[str, torch.Tensor]
    """gamma_k after local training: the only tensors that leave the site."""
    num_examples: int
    """Training samples of the site (FedAvg weight)."""
    mean_loss: float
    seconds: float
    metrics: dict[str, float]
    """The method's own scalars for the server (Method.reply_metrics)."""
    loader_seconds: float = 0.0
    """Of ``seconds``, the time the training steps waited for their next batch (the loader)."""


class Site:
    """A federated site: local data, the local model v_k and its private state."""

    def __init__(
        self,
        name: str,
        cfg: ExperimentConfig,
        state_dir: Path,
        device: torch.device,
        *,
        progress: bool = False,
    ) -> None:
        self.name = name
        self.cfg = cfg
        self.state_dir = state_dir
        self.device = device
        self.progress = progress
        self.method = method_of(cfg)
        parties = self.method.training_sites()  # the federated sites (upper bound: the pool)
        if name not in parties:
            raise ValueError(
                f"this node is site {name!r}, which is not in the federation {list(parties)}; "
                f"check site-name in its node config"
            )
        self.index = parties.index(name)
        self.data = open_party_data(cfg, self.method, name)
        configure_device(
            device,
            tf32=cfg.train.tf32,
            cudnn_benchmark=cfg.train.cudnn_benchmark,
            deterministic=cfg.train.deterministic,
        )
        self.model = self.method.build_model().to(device)
        self.channels_last = use_channels_last(self.model, device, cfg.train.channels_last)
        """Whether the model and its input clips are in channels_last order (CUDA only)."""
        self.precision = resolve_precision(cfg.train.amp_dtype, device)
        if isinstance(self.model, FedSTNet):  # its temporal layouts, built outside any graph
            self.model.prepare_temporal(tuple(cfg.clip.image_size))
        self.training_step = CompiledStep(self._forward_loss, cfg.train.compile, device)
        """The training iteration (:meth:`_forward_loss`, its backward pass and AdamW's step),
        compiled per ``train.compile`` from this cold model, with static input buffers and CUDA
        graphs under reduce-overhead (fedst/accel/compiled.py); the model itself stays eager
        (evaluation, export)."""
        facts = device_facts(device, self.precision, cfg.train.compile)
        log.info("site %s: %s", name, facts.line())  # what this site really computes with
        self.scaler = self.precision.grad_scaler()
        """fp16 loss scaling (None in bf16 / fp32); saved with the optimizer."""
        self.partition = self.method.partition(self.model)
        self.personal_keys = frozenset(self.partition.personal)
        self.loss_fn = self.method.segmentation_loss()
        if cfg.train.clip_frame_loss_weight > 0 and self.method.clip_frame_loss_weight == 0:
            log.info("site %s: train.clip_frame_loss_weight unused: no temporal module", name)
        self.indicators = self.method.indicators()
        self.indicator = self.indicators.get(name)
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model.named_parameters(), cfg.train),  # fedst/methods/optimizer.py
            lr=cfg.train.lr,
            weight_decay=cfg.train.weight_decay,
            **fused_optimizer_options(device),
        )
        self.stream = BatchStream(
            self.data.train,
            batch_size=cfg.train.batch_size,
            seed=cfg.seed * 1000 + self.index,
            num_workers=cfg.train.num_workers,
            device=device,
            num_classes=cfg.network.num_classes,
        )
        self.completed_round = 0
        self.build_reported = False
        """Set once a train reply has reported that this Site was built (fedst/app/client_app.py:
        under Ray, a site built twice moved to another actor)."""
        self.disk_restores = 0
        """States loaded from disk since this Site was built (:meth:`restore`, for any message):
        under Ray, each one is a message that found its site's state in another actor's hands."""
        self.restores_reported = 0
        """:attr:`disk_restores` as the last train reply reported them."""
        self.trainable = True
        """False after :meth:`restore` of a finished run's state (models only)."""
        self.loader_seconds = 0.0
        """Time the current round's steps waited for batches (the loader), in seconds."""
        self.keep_rounds: tuple[int, ...] = ()
        """Rounds of the server's checkpoints (its train message): states :meth:`save` keeps."""
        self._validation: dict[str, ClipDataset] | None = None
        self.evaluation_loaders = FrameLoaders()
        """The evaluation loaders of this site's test and validation sets, whose workers persist
        for the run (:meth:`close_loaders`)."""
        self.owns_whole_model = False
        """True after a final stage (Method.final_stage): every float tensor is then the site's."""
        self.data_changed = False
        """Its training data differ in size from those of its last restored state (the train
        reply says so, so the server accepts the new size, fedst/federation/reply_checks.py)."""
        wait_for_state_writes(state_dir)  # a Site of this folder dropped from this process
        remove_stale_tmp(state_dir)  # left by a site killed while saving
        self.fingerprint = claim_state_dir(state_dir, name, cfg)

    @property
    def num_examples(self) -> int:
        return len(self.data.train)

    # -- Algorithm 1, lines 5-7 ----------------------------------------------------------------
    def train_round(
        self,
        received: dict[str, torch.Tensor],
        server_round: int,
        local_iters: int,
        keep_rounds: Sequence[int] = (),
    ) -> LocalRoundResult:
        """Adopt gamma_g (round 1: the server's full initial model), train E iterations in the
        method's phases, return gamma_k. ``keep_rounds``: rounds of the server's checkpoints,
        whose states the site keeps beside its two latest (:meth:`save`)."""
        self.keep_rounds = tuple(keep_rounds)
        self.restore(server_round - 1)
        self._require_trainable(server_round - 1)
        if self.completed_round > 0:  # rho_k is the site's own from its first round on
            received = {k: v for k, v in received.items() if k not in self.personal_keys}
        self.method.adopt(self, received, server_round)
        seed_everything(self.cfg.seed, self.index, server_round)
        started, losses = time.perf_counter(), []
        self.loader_seconds = 0.0
        for phase in self.method.local_phases(local_iters):
            losses += self.train_phase(phase, server_round)
        shared = bulk_to_host(self._device_state(self.partition.shared)).wait()  # one copy
        floats = {k: v for k, v in shared.items() if v.is_floating_point()}
        finite = [v.isfinite().all() for v in floats.values()]  # on the host copies
        if finite and not bool(torch.stack(finite).all()):
            bad = [k for k, ok in zip(floats, finite, strict=True) if not ok]
            raise NonFiniteUpdateError(
                f"site {self.name}: {len(bad)} shared parameter(s) hold NaN or inf after local "
                f"training in round {server_round}, e.g. {bad[:3]}; nothing is sent and the site "
                f"keeps its state of round {server_round - 1}. Lower train.lr or enable "
                f"train.max_grad_norm."
            )
        self.completed_round = server_round
        self.save(server_round, shared=shared)  # gamma_k's host copy: the reply's and the file's
        return LocalRoundResult(
            shared=shared,
            num_examples=self.num_examples,
            mean_loss=sum(losses) / max(len(losses), 1),
            seconds=time.perf_counter() - started,
            metrics=self.method.reply_metrics(self),
            loader_seconds=self.loader_seconds,
        )

    def train_phase(
        self,
        phase: LocalPhase,
        server_round: int,
        optimizer: torch.optim.Optimizer | None = None,
        loss_of: BatchLoss | None = None,
    ) -> list[float]:
        """``phase.iterations`` AdamW steps on L (the method's local loss); parameters that the
        phase does not train get no gradient, so the optimizer leaves them (and their moments)
        untouched. A final stage passes its own ``optimizer`` and ``loss_of(clips, logits,
        masks)``."""
        optimizer = optimizer or self.optimizer
        frozen = [
            p
            for key, p in self.model.named_parameters()
            if phase.trainable is not None and not phase.trainable(key)
        ]
        for parameter in frozen:
            parameter.requires_grad_(False)
        indicator = self.indicator.to(self.device) if self.indicator is not None else None
        self.model.train()
        losses = LossLog()
        iterations = progress_bar(
            range(phase.iterations),
            desc=f"site {self.name} round {server_round} {phase.name}",
            enabled=self.progress,
            leave=False,
        )
        try:
            first_iteration = (server_round - 1) * self.cfg.train.local_iters
            for step in iterations:
                if self.cfg.train.lr_schedule != "constant":
                    set_lr_factor(optimizer, lr_factor(first_iteration + step, self.cfg.train))
                # on the device, normalised: [B, T, 3, H, W] float32, [B, H, W] int64
                waited = time.perf_counter()
                clips, batch_masks, _ = self.stream.next_batch()
                self.loader_seconds += time.perf_counter() - waited
                clips, masks, frame_masks = self.step_inputs(clips, batch_masks)
                if loss_of is None:
                    (loss,) = self.training_step.step(
                        (clips, indicator, masks, frame_masks),
                        optimizer,
                        self.scaler,
                        self.model.parameters(),
                        self.cfg.train.max_grad_norm,
                    )
                else:  # a final stage's own loss: eager
                    with self.precision.autocast():
                        logits = self.model(clips, indicator)  # [B, C, H, W]
                        loss = loss_of(clips, logits.float(), masks)
                    optimizer_step(
                        loss,
                        optimizer,
                        self.scaler,
                        self.model.parameters(),
                        self.cfg.train.max_grad_norm,
                    )
                losses.append(loss)  # stays on the device: no host sync per step
        finally:
            for parameter in frozen:
                parameter.requires_grad_(True)
        values = losses.values()  # the phase's one host sync
        bad = first_non_finite(values)
        if bad is not None:
            raise NonFiniteLossError(
                f"site {self.name}: loss is {values[bad]} at round {server_round}, local "
                f"iteration {bad} ({phase.name}); the run stops here and keeps the "
                f"checkpoint of round {server_round - 1}. Lower train.lr or enable "
                f"train.max_grad_norm."
            )
        return values

    def step_inputs(
        self, clips: torch.Tensor, batch_masks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A batch of the site's stream as its training step takes it: (clips [B, T, 3, H, W],
        channels_last where the model is; the current frames' masks [B, H, W]; every clip
        frame's masks [B, T, H, W] where the stream carries them (``train.clip_frame_loss_weight``
        > 0), else None)."""
        if self.channels_last:
            clips = clips_channels_last(clips)
        frame_masks = batch_masks if batch_masks.dim() == 4 else None
        return clips, current_frame_masks(batch_masks), frame_masks

    def _forward_loss(
        self,
        clips: torch.Tensor,
        indicator: torch.Tensor | None,
        masks: torch.Tensor,
        frame_masks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The method's local loss L of one batch under the mixed precision: clips
        [B, T, 3, H, W], masks [B, H, W] -> scalar (what ``train.compile`` compiles). With
        ``frame_masks`` (every clip frame's labels [B, T, H, W], ``train.clip_frame_loss_weight``
        > 0) L adds the method's term of every clip frame's own prediction (CFFM)."""
        with self.precision.autocast():
            if frame_masks is None:
                logits = self.model(clips, indicator)  # [B, C, H, W]
                return self.method.local_loss(self, logits.float(), masks)
            # [B, C, H, W], [B, T, C, H, W]: one encoder pass over the clip
            logits, frame_logits = self.model(clips, indicator, return_frame_logits=True)
            loss = self.method.local_loss(self, logits.float(), masks)
            return loss + self.method.clip_frame_term(self, frame_logits.float(), frame_masks)

    def final_stage(
        self,
        shared: dict[str, torch.Tensor],
        others: dict[str, dict[str, torch.Tensor]],
        server_round: int,
    ) -> LocalRoundResult:
        """The method's stage after the last round (``server_round`` = T + 1): start from
        v_k = gamma_g U rho_k of round T, run Method.run_final_stage with the other sites' rho_j
        (``others``), then keep and save the whole model as this site's own."""
        self.restore(server_round - 1)
        self._require_trainable(server_round - 1)
        load_subset(self.model, {k: v for k, v in shared.items() if k not in self.personal_keys})
        seed_everything(self.cfg.seed, self.index, server_round)
        started = time.perf_counter()
        metrics = self.method.run_final_stage(self, shared, others, server_round)
        self.owns_whole_model = True
        self.completed_round = server_round
        self.save(server_round)
        return LocalRoundResult(
            shared={},
            num_examples=self.num_examples,
            mean_loss=float(metrics.get(TRAIN_LOSS, float("nan"))),
            seconds=time.perf_counter() - started,
            metrics=metrics,
        )

    def evaluate(
        self,
        received: dict[str, torch.Tensor],
        server_round: int,
        keep_examples: int = 0,
        split: str = "test",
    ) -> dict[str, EvaluationResult]:
        """Score the model the site returns after ``server_round`` (Method.load_returned_model:
        its own v_k = gamma_k U rho_k, or gamma_g as adopted from ``received`` U rho_k) on the
        test split of every site the method scores it on (Method.scored_sites: the site's own),
        each prompted as that site; by scored site. With ``split="val"`` on their validation
        splits, and the rho_k (and own gamma_k) scored is kept for selection
        (fedst/federation/snapshots.py)."""
        self.restore(server_round)
        self.method.load_returned_model(self, received, server_round)
        if split == "val":
            datasets = self.validation_data()
            save_personal_snapshot(
                self.state_dir,
                server_round,
                self.name,
                self.personal_state(),
                self.num_examples,
                shared=self.own_shared_state() if self.method.returns_own_model else None,
            )
        elif split == "test":
            datasets = self.data.tests
        else:
            raise ValueError(f"site {self.name}: unknown evaluation split {split!r} (test | val)")
        return {
            site: evaluate_model(
                self.model,
                dataset,
                self.indicators.get(site),
                self.device,
                keep_examples=keep_examples,
                progress=self.progress,
                loaders=self.evaluation_loaders,
                **self.cfg.train.evaluation_options(server_round),
            )
            for site, dataset in datasets.items()
        }

    def close_loaders(self) -> None:
        """Stop the worker processes of the training stream and of the evaluation loaders (a
        later batch or evaluation starts new ones)."""
        self.stream.close()
        self.evaluation_loaders.close()

    def validation_data(self) -> dict[str, ClipDataset]:
        """The validation clips of every site this model is scored on (data.val_split,
        fedst/data/splits.py), opened once."""
        if self._validation is None:
            self._validation = {
                site: validation_dataset(
                    self.cfg.data.open(site), self.cfg.data.val_split, self.cfg.clip_config()
                )
                for site in self.method.scored_sites(self.name)
            }
        return self._validation

    def personal_state(self) -> dict[str, torch.Tensor]:
        """rho_k as CPU tensors (sent once, at the end, only when the site allows it); after a
        final stage every float tensor of the model (it is all the site's own)."""
        return state_subset(self.model, self._saved_personal_keys())

    def own_shared_state(self) -> dict[str, torch.Tensor]:
        """gamma_k as CPU tensors: the site's own shared parameters after its last local round
        (what it sent), the shared part of the model it returns under returned_model=own."""
        return state_subset(self.model, self.partition.shared)

    # -- private state on disk -----------------------------------------------------------------
    def state_path(self, server_round: int) -> Path:
        return site_state_file(self.state_dir, server_round)

    def save(self, server_round: int, shared: dict[str, torch.Tensor] | None = None) -> None:
        """Persist rho_k, the own gamma_k, optimizer moments and data order after
        ``server_round``. Keeps this round's and the previous round's states and those of the
        server's checkpoint rounds (``keep_rounds``: a resumed run restarts after one of them);
        older ones are deleted. Called right after local training, so ``shared`` is gamma_k^t,
        never gamma_g: its host copy when the caller has one (the reply's), else copied here.

        The state's tensors reach the host in one copy per device (fedst.accel.bulk_to_host)
        and the file is written by the process's state writer (fedst/federation/state_writer.py)
        after this site's previous write, while the caller goes on."""
        device_state = {
            "round": server_round,
            "site": self.name,
            "personal": self._device_state(self._saved_personal_keys()),
            "method": self.method.site_state(self),
            "optimizer": self.optimizer.state_dict(),
            **({"scaler": self.scaler.state_dict()} if self.scaler is not None else {}),
            "stream": self.stream.state_dict(),
            "num_examples": self.num_examples,
            "whole_model": self.owns_whole_model,
        }
        if shared is None:
            device_state["shared"] = self._device_state(self.partition.shared)
        copy = bulk_to_host(device_state)  # one copy; the writer thread waits for it
        path, state_dir = self.state_path(server_round), self.state_dir
        kept = {server_round, server_round - 1, *self.keep_rounds}

        def write() -> None:
            state = copy.wait()
            state = standalone({**state, **({"shared": shared} if shared is not None else {})})
            atomic_torch_save(state, path)
            for stale in saved_rounds(state_dir):
                if stale < server_round and stale not in kept:
                    site_state_file(state_dir, stale).unlink(missing_ok=True)

        write_in_background(state_dir, write)

    def _saved_personal_keys(self) -> list[str]:
        """The state-dict keys saved as "personal": rho_k, or after a final stage every float
        tensor of the model (:meth:`personal_state`'s)."""
        if self.owns_whole_model:
            return [*self.partition.shared, *self.partition.personal]
        return list(self.partition.personal)

    def _device_state(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        """The model's state-dict entries ``keys``, detached, where they are (no copy)."""
        state = self.model.state_dict()
        return {key: state[key].detach() for key in keys}

    def restore(self, server_round: int) -> None:
        """Make the in-memory state that of the end of ``server_round`` (0: fresh start), or of
        the site's last round before it when the site missed rounds (it dropped out)."""
        wait_for_state_writes(self.state_dir)  # this site's last save is on disk
        if self.completed_round == server_round:
            return
        path = self.state_path(server_round)
        if not path.exists():
            earlier = [r for r in saved_rounds(self.state_dir) if r < server_round]
            if earlier and earlier[-1] == self.completed_round:
                return
            if not earlier and self.completed_round == 0:
                log.info(
                    "site %s: no private state before round %d, starting fresh",
                    self.name,
                    server_round,
                )
                return
            if not earlier:
                raise FileNotFoundError(
                    f"site {self.name}: no saved state for round {server_round} at {path}; "
                    f"resume from the run's last completed round or start a new run"
                )
            path = self.state_path(earlier[-1])
            log.info(
                "site %s: missed rounds %d-%d, continuing from its state of round %d",
                self.name,
                earlier[-1] + 1,
                server_round,
                earlier[-1],
            )
        try:
            state = load_checkpoint(path, self.device)
        except CheckpointError as err:
            raise CheckpointError(
                f"site {self.name}: {err}. Its previous round is kept in "
                f"{self.state_path(server_round - 1)}; resuming the run falls back to it"
            ) from err
        saved_examples = state.get("num_examples", self.num_examples)
        if saved_examples != self.num_examples:
            log.warning(
                "site %s: %d training samples now, %d in its state of round %d",
                self.name,
                self.num_examples,
                saved_examples,
                state["round"],
            )
        self.data_changed = saved_examples != self.num_examples
        load_subset(self.model, state.get("shared", {}))  # gamma_k: v_k is the site's own again
        load_subset(self.model, state["personal"])
        self.method.load_site_state(self, state.get("method", {}))
        self.owns_whole_model = bool(state.get("whole_model", False))
        self.completed_round = server_round
        self.disk_restores += 1
        self.trainable = "optimizer" in state  # a finished run keeps models only (footprint.py)
        if not self.trainable:
            return
        self.optimizer.load_state_dict(state["optimizer"])
        if self.channels_last:
            match_parameter_layouts(self.optimizer)
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.stream.load_state_dict(state["stream"])

    def _require_trainable(self, server_round: int) -> None:
        """A state restored from a finished run (its models only: no AdamW moments, no data
        order, fedst/runs/footprint.py) can be scored, not trained on: a CheckpointError."""
        if not self.trainable:
            raise CheckpointError(
                f"site {self.name}: its state of round {server_round} is a finished run's, which "
                "keeps its models only (no optimizer moments or data order), so it cannot be "
                "trained further; train.keep_resume_state=true keeps what training on needs"
            )

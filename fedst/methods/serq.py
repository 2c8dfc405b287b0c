# Over 600 lines: SERQ's server step is one algorithm (Eq. 10-12: EQ and SC over one round's plan, the
# descriptor, the feature bank, their checkpoint state) whose parts share the Serq object's state;
# the bank's storage is already its own module (feature_bank.py).
"""Synthesis-based Explicit Representation Quantification (SERQ, paper Sec. III-C, Eq. 10-12).

Server-only, on synthetic images (no temporal module). State:

* ``synthetic_model`` v_pre: pre-trained once on the synthetic set, then updated by the EQ step.
* ``domain_descriptor`` D_sy [C, h, w]: one learnable tensor for the synthetic domain at the
  feature stage, initialised randomly (N(0, 0.02)).
* ``feature_bank`` F_hat_g: per synthetic sample, the EMA (Eq. 10) of the global model's encoder
  features at that stage, **of the sample's canonical (un-augmented) view**. It is updated lazily,
  when a sample is drawn (first visit initialises it to F_g), so each round costs only the batches
  SERQ trains on. Stored on CPU in float16, in memory or in a scratch file
  (``serq.bank_storage``, fedst/methods/feature_bank.py).

Each round (Algorithm 1, lines 10-11) draws ``batches_per_round`` synthetic batches of
``batch_size`` samples (augmented: rotation and scale, as all training in the paper), then
  EQ: global model fixed; train v_pre and D_sy on L_pre = L_seg + lambda2 * mean||F_sy - D_sy - F_hat_g||^2 (Eq. 11)
  SC: v_pre and D_sy fixed; train v_g on L_g = L_seg + lambda3 * mean||F_g - (F_sy - D_sy)||^2 (Eq. 12)
over the same samples, with Adam (lr 1e-4) whose moments persist across rounds (D_sy: its own
step).

Data path. A round first draws its plan, the (sample index, augmentation seed) pairs of its
``batches_per_round`` batches (:meth:`BatchStream.next_plan`, the stream advancing as that many
``next_batch`` calls would); EQ then reads the plan's canonical views and SC its augmented views
batch by batch through the stream's loader workers, so one batch (plus the workers' prefetch) is
in memory at a time instead of the round's 2 x ``batches_per_round`` batches. Synthetic images
are read as 1-frame clips (server.py): SERQ's forward passes use only the current frame. The
stream keeps one loader per dataset with persistent workers (fedst/data/clips/loaders.py), so
both passes reuse the same workers every round, and SC's pass starts loading while EQ runs.

On the device (design note). The EQ loop makes no blocking copy between host and device: a
batch's bank entries are read at once (:func:`~fedst.methods.feature_bank.read_entries`, into
pinned memory on CUDA) and copied to the device without a host wait; Eq. 10's update runs on the
device, and the round's new entries stay there (a later batch of the round that draws the sample
again reads them there) until one copy to the host and one batched write after the loop. The
forward passes and losses of EQ and SC, with their backward passes, are compiled per
``train.compile`` as whole iterations with static input buffers (fedst.accel.CompiledStep; CUDA
graphs with reduce-overhead, the fused optimizers beside them), the bank's F_g pass per
``train.compile`` (fedst.accel.maybe_compile), and with
``train.channels_last`` the models and images are in channels_last order on CUDA.

Server fine-tuning (``serq.mode=finetune``; the blue line of Fig. 5, Sec. IV-C5: "the
synthetic data is directly utilized to fine-tune the averaged global model on the server side").
The same round without what makes SERQ: no EQ step (v_pre, D_sy and the feature bank are never
read or changed after pre-training, and no canonical view is loaded), and the SC loop with its
feature term switched off, i.e. the global model takes one Adam step on L_seg(v_g(x_sy), y_sy)
per augmented batch [B, T=1, 3, H, W] of the round's plan: the same ``batches_per_round``
batches of ``batch_size`` samples, the same augmentation and the same persistent Adam (lr) as
SC. ``lambda_sc`` and ``lambda_eq`` play no part. The round's statistics carry the SC loss
(= L_seg) and the RMS of F_g; the EQ and descriptor fields are None.

Design notes (the feature stage F_ts, the descriptor's own step, the canonical and augmented
views, the bank's refresh rate): docs/design-notes.md, "SERQ's design notes".
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedst.accel import (
    CompiledStep,
    LossLog,
    Precision,
    begin_step,
    clips_channels_last,
    fused_optimizer_options,
    match_parameter_layouts,
    maybe_compile,
    use_channels_last,
    uses_cuda_graphs,
)
from fedst.data.clips import BatchStream, ClipDataset, PlannedBatches
from fedst.experiment import ExperimentConfig, SerqConfig
from fedst.methods.feature_bank import (
    FEATURE_BANK_DIR,
    SERQ_BANK_SCRATCH,
    BankWrite,
    DiskFeatureBank,
    FeatureBankStore,
    read_entries,
    write_entries,
)
from fedst.methods.pretraining import PretrainResult, pretrain_on_synthetic, synthetic_stream
from fedst.methods.server_step import ServerContext, StepFiles
from fedst.model.losses import SegmentationLoss
from fedst.model.network import FedSTNet

log = logging.getLogger(__name__)


@dataclass
class SerqRoundStats:
    """What one round of SERQ did, logged in train.jsonl (server rows) and TensorBoard."""

    eq_loss: float | None
    """Mean L_pre over the round's batches (Eq. 11); None in finetune mode (no EQ step)."""
    eq_feature_gap: float | None
    """Mean ||F_sy - D_sy - F_hat_g||^2 / N_e; None in finetune mode."""
    sc_loss: float
    """Mean L_g over the round's batches (Eq. 12); in finetune mode the mean L_seg."""
    sc_feature_gap: float | None
    """Mean ||F_g - (F_sy - D_sy)||^2 / N_e; None in finetune mode (no feature term)."""
    descriptor_norm: float | None = 0.0
    """||D_sy||_2 after the round (None in finetune mode: D_sy plays no part)."""
    descriptor_rms: float | None = 0.0
    """RMS of D_sy's elements after the round (compare with the feature RMS below)."""
    synthetic_feature_rms: float | None = 0.0
    """RMS of F_sy, v_pre's features, over the round's EQ batches."""
    bank_feature_rms: float | None = 0.0
    """RMS of F_hat_g, the bank entries the EQ batches read."""
    global_feature_rms: float = 0.0
    """RMS of F_g, the global model's features, over the round's SC batches."""
    eq_seconds: float = 0.0
    """Wall time of the EQ step (drawing and loading the round's batches included)."""
    sc_seconds: float = 0.0
    """Wall time of the SC step."""


class Serq:
    """The server step of FedST. ``global_model`` is passed in each round; v_pre and D_sy live here."""

    def __init__(
        self,
        cfg: SerqConfig,
        synthetic_model: nn.Module,
        stream: BatchStream,
        reference: ClipDataset,
        indicator: torch.Tensor | None,
        loss_fn: SegmentationLoss,
        device: torch.device,
        feature_stage: int,
        precision: Precision | None = None,
        feature_bank: MutableMapping[str, torch.Tensor] | None = None,
        compile_mode: str = "none",
        channels_last: bool = False,
    ) -> None:
        """``precision``: the server's mixed precision (fedst.accel.resolve_precision of
        ``train.amp_dtype``; None: fp32) for every forward pass of SERQ. ``feature_bank``: the
        empty mapping that holds F_hat_g (``serq.bank_storage``: a dict, or a
        :class:`~fedst.methods.feature_bank.DiskFeatureBank`; None: a dict).
        ``compile_mode``: ``train.compile`` of SERQ's passes; ``channels_last``:
        ``train.channels_last`` (CUDA only; v_pre here, the global model at each step)."""
        self.cfg = cfg
        self.precision = precision or Precision(device.type)
        self.pre_scaler = self.precision.grad_scaler()
        """fp16 loss scaling of v_pre's losses (pre-training and EQ, whose step also moves D_sy)."""
        self.global_scaler = self.precision.grad_scaler()
        """fp16 loss scaling of the global model's SC loss."""
        self.feature_stage = feature_stage
        """Encoder stage of F (``SerqConfig.feature_stage`` resolved; see the module docstring)."""
        self.synthetic_model = synthetic_model
        self.channels_last = use_channels_last(synthetic_model, device, channels_last)
        """Whether the models and images of SERQ's passes are in channels_last order."""
        self.cuda_graphs = uses_cuda_graphs(compile_mode, device)
        """Whether the compiled bank pass replays CUDA graphs."""
        self.eq_step = CompiledStep(self._eq_objective, compile_mode, device)
        """EQ's iteration (forward, loss, backward, v_pre's Adam and D_sy's SGD) compiled per
        ``train.compile``, with static input buffers (fedst/accel/compiled.py)."""
        self.sc_step = CompiledStep(self._sc_objective, compile_mode, device)
        """SC's iteration (forward passes, loss, backward, the global model's Adam), likewise."""
        self._bank_pass = maybe_compile(self._features, compile_mode)
        self.stream = stream
        self.reference = reference
        """The synthetic set without augmentation: the canonical view of each sample (EQ, bank)."""
        self.indicator = indicator.to(device) if indicator is not None else None
        self.loss_fn = loss_fn
        self.device = device
        self.domain_descriptor = nn.Parameter(self._probe_feature_shape().normal_(0.0, 0.02))
        self.feature_bank: MutableMapping[str, torch.Tensor] = (
            {} if feature_bank is None else feature_bank
        )
        self._bank_changed: set[str] = set()
        """Samples whose bank entry changed since the bank was last saved or loaded."""
        self._bank_on_disk = False
        """Whether the bank's folder holds this bank but for ``_bank_changed`` (False: a new run,
        or a checkpoint with the bank inside; the next save writes every entry)."""
        self.pre_optimizer = torch.optim.Adam(
            synthetic_model.parameters(), lr=cfg.lr, **fused_optimizer_options(device)
        )
        curvature = 2 * cfg.lambda_eq / self.domain_descriptor.numel()  # of Eq. 11 in each element
        self.descriptor_optimizer = torch.optim.SGD(
            [self.domain_descriptor], lr=cfg.descriptor_step / curvature
        )
        self.global_optimizer: torch.optim.Adam | None = None
        self.pretrained_iters = 0

    # -- helpers --------------------------------------------------------------------------------
    def _forward(self, model: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """images [B, T, 3, H, W] -> (logits [B, C, H, W], F at the SERQ stage [B, c, h, w]),
        the forward under the mixed precision, both returned in float32 (no-op in fp32)."""
        with self.precision.autocast():
            logits, feats = model(images, self.indicator, use_temporal=False, return_features=True)
        return logits.float(), feats[self.feature_stage].float()

    def _features(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """images [B, T, 3, H, W] -> F at the SERQ stage [B, c, h, w] in float32, as
        :meth:`_forward` returns it, without the later encoder stages and the decoder: the passes
        that read only F (the bank's F_g, SC's F_sy)."""
        with self.precision.autocast():
            feats = model.encoder_features(images, self.feature_stage)
        return feats.float()

    @torch.no_grad()
    def _probe_feature_shape(self) -> torch.Tensor:
        clip, _, _ = self.stream.dataset[0]  # [T, 3, H, W]
        self.synthetic_model.eval()
        feat = self._features(self.synthetic_model, clip[None].to(self.device))
        return torch.empty(feat.shape[1:], device=self.device)  # [c, h, w]

    def _draw_plan(self) -> list[list[tuple[int, int]]]:
        """The round's ``batches_per_round`` batches as (sample index, augmentation seed) pairs
        (:meth:`BatchStream.next_plan`: what as many ``next_batch`` calls would have drawn)."""
        return self.stream.next_plan(self.cfg.batches_per_round)

    def augmented_batches(self, plan: list[list[tuple[int, int]]]) -> PlannedBatches:
        """The plan's augmented batches (images [B, T, 3, H, W], masks [B, H, W], ids), streamed."""
        return self.stream.load_plan(plan)

    def canonical_batches(self, plan: list[list[tuple[int, int]]]) -> PlannedBatches:
        """The plan's samples without augmentation (images [B, T, 3, H, W], masks [B, H, W],
        ids), batch by batch, streamed through the stream's workers from ``reference``."""
        dataset = self.stream.dataset
        canonical = [
            [(self.reference.index_of(dataset.sample_id(index)), seed) for index, seed in batch]
            for batch in plan
        ]
        return self.stream.load_plan(canonical, self.reference)

    def canonical_view(self, ids: list[str]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """The un-augmented (images [B, T, 3, H, W], masks [B, H, W], ids) of the samples ``ids``
        (one batch of :meth:`canonical_batches`), on the device."""
        (batch,) = self.stream.load_plan(
            [[(self.reference.index_of(sample_id), 0) for sample_id in ids]], self.reference
        )
        return batch

    # -- synthetic pre-training of v_pre (Algorithm 1 input v_pre^0) ----------------------------
    def pretrain(self, iters: int, progress: bool = False) -> PretrainResult:
        """Train v_pre on the synthetic set with L_seg (the pre-training every method gets,
        fedst/methods/pretraining.py); returns its loss and cost."""
        result = pretrain_on_synthetic(
            self.synthetic_model,
            self.pre_optimizer,
            self.stream,
            self.indicator,
            self.loss_fn,
            iters,
            self.device,
            progress=progress,
            precision=self.precision,
            scaler=self.pre_scaler,
        )
        self.pretrained_iters += iters
        return result

    # -- Eq. 10 + Eq. 11 -----------------------------------------------------------------------
    @torch.no_grad()
    def update_feature_bank(
        self, global_model: nn.Module, images: torch.Tensor, ids: list[str]
    ) -> torch.Tensor:
        """F_hat_g <- (1 - mu) F_hat_g + mu F_g for the batch's samples (Eq. 10), written to the
        bank at once; returns F_hat_g [B, c, h, w] float32 on the device.

        ``images`` must be the canonical views of ``ids`` (:meth:`canonical_view`).
        """
        updated: dict[str, torch.Tensor] = {}
        rows = self._refreshed_rows(global_model, images, list(ids), updated)
        self._write_bank(updated)
        return rows

    @torch.no_grad()
    def _refreshed_rows(
        self,
        global_model: nn.Module,
        images: torch.Tensor,
        ids: list[str],
        updated: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """Eq. 10 for one batch on the device: images [B, T, 3, H, W] (canonical views of
        ``ids``) -> F_hat_g^{t+1} [B, c, h, w] float32. The new entries (float16 [c, h, w], as
        the bank stores them) go to ``updated`` (sample id -> entry on the device), which also
        holds the entries of the round's earlier batches: those are read from it, the others
        from the bank, one batched read. A sample twice in the batch is updated twice, in order.
        """
        global_model.eval()
        fresh = self._bank_pass(global_model, images).to(torch.float16)  # F_g [B, c, h, w]
        mu = self.cfg.ema_mu
        rows: list[torch.Tensor | None] = [None] * len(ids)
        for wave in _occurrences(ids):  # one wave unless a sample repeats in the batch
            wave_ids = [ids[i] for i in wave]
            new = fresh if len(wave) == len(ids) else torch.stack([fresh[i] for i in wave])
            stored = [i for i in wave_ids if i not in updated and i in self.feature_bank]
            loaded = dict(zip(stored, self._read_bank(stored), strict=True))
            olds = [updated.get(i, loaded.get(i)) for i in wave_ids]  # None: a first visit
            if all(old is None for old in olds):
                entries = new
            else:
                old = torch.stack([n if o is None else o for o, n in zip(olds, new, strict=True)])
                entries = ((1 - mu) * old.float() + mu * new.float()).half()
                if any(old is None for old in olds):
                    visited = [old is not None for old in olds]
                    mask = self._to_device(torch.tensor(visited)).view(-1, 1, 1, 1)
                    entries = torch.where(mask, entries, new)
            for position, sample_id, entry in zip(wave, wave_ids, entries, strict=True):
                updated[sample_id] = entry
                rows[position] = entry
        return torch.stack(rows).float()  # type: ignore[arg-type]

    def _read_bank(self, ids: list[str]) -> torch.Tensor:
        """Bank entries of ``ids`` [N, c, h, w] float16 on the device: one read on the host
        (into pinned memory on CUDA) and a copy without a host wait."""
        if not ids:
            return torch.empty(0, device=self.device)
        shape = (len(ids), *self.domain_descriptor.shape)
        pinned = self.device.type == "cuda"
        host = torch.empty(shape, dtype=torch.float16, pin_memory=pinned)
        return self._to_device(read_entries(self.feature_bank, ids, out=host))

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device without a host wait (pinned first on CUDA)."""
        if self.device.type == "cuda" and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def _write_bank(self, updated: dict[str, torch.Tensor]) -> None:
        """Write the entries of ``updated`` (on the device) to the bank: one copy to the host,
        one batched write."""
        if not updated:
            return
        ids = list(updated)
        write_entries(self.feature_bank, ids, torch.stack([updated[i] for i in ids]).cpu())
        self._bank_changed.update(ids)

    def explicit_quantification(
        self, global_model: nn.Module, batches
    ) -> tuple[float, float, float, float]:
        """EQ step: update v_pre (Adam) and D_sy (its gradient step) with the global model fixed
        (Eq. 11). Returns the means over the batches of L_pre, the feature gap, and the RMS of
        F_sy and of F_hat_g.

        ``batches``: canonical views (:meth:`canonical_view`), the view the bank holds.
        """
        self.synthetic_model.train()
        self._prepare(global_model)
        losses, gaps, syn_squares, bank_squares = LossLog(), LossLog(), LossLog(), LossLog()
        updated: dict[str, torch.Tensor] = {}  # the round's new bank entries, on the device
        for images, masks, ids in batches:
            begin_step(self.cuda_graphs)
            images, masks = self._inputs(images, masks)
            bank = self._refreshed_rows(global_model, images, list(ids), updated)  # F_hat_g^{t+1}
            # one backward, then v_pre's Adam and D_sy's SGD each step once
            loss, gap, syn_square = self.eq_step.step(
                (images, masks, bank),
                (self.pre_optimizer, self.descriptor_optimizer),
                self.pre_scaler,
                [*self.synthetic_model.parameters(), self.domain_descriptor],
            )
            losses.append(loss)  # kept on the device; read after the loop
            gaps.append(gap)
            syn_squares.append(syn_square)
            bank_squares.append(bank.pow(2).mean())
        self._write_bank(updated)
        n = len(batches)
        total, gap_total = _sum(losses), _sum(gaps)
        syn_square, bank_square = _sum(syn_squares), _sum(bank_squares)
        return total / n, gap_total / n, (syn_square / n) ** 0.5, (bank_square / n) ** 0.5

    def _eq_objective(
        self, images: torch.Tensor, masks: torch.Tensor, bank: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """EQ's forward pass and loss on one batch (what ``train.compile`` compiles): images
        [B, T, 3, H, W], masks [B, H, W], F_hat_g [B, c, h, w] -> (L_pre of Eq. 11, the feature
        gap, mean F_sy^2)."""
        logits, feat_syn = self._forward(self.synthetic_model, images)  # [B, c, h, w]
        gap = (feat_syn - self.domain_descriptor - bank).pow(2).mean()
        loss = self.loss_fn(logits, masks) + self.cfg.lambda_eq * gap
        return loss, gap, feat_syn.detach().pow(2).mean()

    def _sc_objective(
        self, global_model: nn.Module, images: torch.Tensor, masks: torch.Tensor, feature_term: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """SC's forward passes and loss on one batch (what ``train.compile`` compiles): images
        [B, T, 3, H, W], masks [B, H, W] -> (L_g of Eq. 12, or L_seg without the feature term;
        the feature gap or None; mean F_g^2)."""
        logits, feat_global = self._forward(global_model, images)  # F_g [B, c, h, w]
        loss = self.loss_fn(logits, masks)
        gap = None
        if feature_term:
            with torch.no_grad():
                feat_syn = self._features(self.synthetic_model, images)
                instrument_repr = feat_syn - self.domain_descriptor  # I_sy [B, c, h, w]
            gap = (feat_global - instrument_repr).pow(2).mean()
            loss = loss + self.cfg.lambda_sc * gap
        return loss, gap, feat_global.detach().pow(2).mean()

    def _prepare(self, global_model: nn.Module) -> None:
        """The global model in channels_last order when asked (in place; once, then a no-op)."""
        if self.channels_last:
            global_model.to(memory_format=torch.channels_last)
            if self.global_optimizer is not None:  # moments of an NCHW model (a checkpoint)
                match_parameter_layouts(self.global_optimizer)

    def _inputs(
        self, images: torch.Tensor, masks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch on the device (copied without a host wait; a no-op for the stream's
        batches), images in channels_last order when asked."""
        images = images.to(self.device, non_blocking=True)
        if self.channels_last:
            images = clips_channels_last(images)
        return images, masks.to(self.device, non_blocking=True)

    # -- Eq. 12 --------------------------------------------------------------------------------
    def synchronize_convergence(
        self, global_model: nn.Module, batches, feature_term: bool = True
    ) -> tuple[float, float | None, float]:
        """SC step: train the global model towards I_sy = F_sy - D_sy with v_pre fixed (Eq. 12).
        Returns the means over the batches of L_g, the feature gap and the RMS of F_g.

        ``feature_term=False`` (finetune mode): the loss is L_seg alone; v_pre and D_sy are not
        read, and the feature gap is None."""
        if self.global_optimizer is None:
            self.global_optimizer = self._global_adam(global_model)
        self.synthetic_model.eval()
        global_model.train()
        self._prepare(global_model)
        losses, gaps, global_squares = LossLog(), LossLog(), LossLog()
        for images, masks, _ in batches:
            images, masks = self._inputs(images, masks)
            loss, gap, global_square = self.sc_step.step(
                (global_model, images, masks, feature_term),
                self.global_optimizer,
                self.global_scaler,
                global_model.parameters(),
            )
            if gap is not None:
                gaps.append(gap)
            losses.append(loss)  # kept on the device; read after the loop
            global_squares.append(global_square)
        n = len(batches)
        total, global_square = _sum(losses), _sum(global_squares)
        gap = _sum(gaps) / n if feature_term else None
        return total / n, gap, (global_square / n) ** 0.5

    def _global_adam(self, global_model: nn.Module) -> torch.optim.Adam:
        """The SC step's Adam on the global model (created at SERQ's first round)."""
        return torch.optim.Adam(
            global_model.parameters(), lr=self.cfg.lr, **fused_optimizer_options(self.device)
        )

    def step(self, global_model: nn.Module) -> SerqRoundStats:
        """One round of SERQ on the freshly aggregated global model (Algorithm 1, lines 10-11),
        or of server fine-tuning in finetune mode (:meth:`finetune_step`)."""
        if self.cfg.mode == "finetune":
            return self.finetune_step(global_model)
        started = time.perf_counter()
        plan = self._draw_plan()
        canonical = self.canonical_batches(plan).start()
        augmented = self.augmented_batches(plan).start()  # SC's batches load while EQ runs
        eq_loss, eq_gap, syn_rms, bank_rms = self.explicit_quantification(global_model, canonical)
        eq_done = time.perf_counter()
        sc_loss, sc_gap, global_rms = self.synchronize_convergence(global_model, augmented)
        descriptor = self.domain_descriptor.detach()
        return SerqRoundStats(
            eq_loss,
            eq_gap,
            sc_loss,
            sc_gap,
            descriptor_norm=descriptor.norm().item(),
            descriptor_rms=descriptor.pow(2).mean().sqrt().item(),
            synthetic_feature_rms=syn_rms,
            bank_feature_rms=bank_rms,
            global_feature_rms=global_rms,
            eq_seconds=eq_done - started,
            sc_seconds=time.perf_counter() - eq_done,
        )

    def finetune_step(self, global_model: nn.Module) -> SerqRoundStats:
        """Fig. 5's server fine-tuning: the round's augmented batches (the plan SERQ would draw)
        through the SC loop without its feature term; EQ, v_pre, D_sy and the bank untouched."""
        started = time.perf_counter()
        plan = self._draw_plan()
        loss, _, global_rms = self.synchronize_convergence(
            global_model, self.augmented_batches(plan), feature_term=False
        )
        return SerqRoundStats(
            eq_loss=None,
            eq_feature_gap=None,
            sc_loss=loss,
            sc_feature_gap=None,
            descriptor_norm=None,
            descriptor_rms=None,
            synthetic_feature_rms=None,
            bank_feature_rms=None,
            global_feature_rms=global_rms,
            eq_seconds=0.0,
            sc_seconds=time.perf_counter() - started,
        )

    # -- checkpointing -------------------------------------------------------------------------
    def save_feature_bank(self, store: FeatureBankStore, server_round: int) -> BankWrite:
        """Write the bank entries changed since the last save or load as of ``server_round``
        (every entry, into an emptied folder, the first time); before the server checkpoint."""
        if self._bank_on_disk:
            changed = self._bank_changed
        else:
            store.clear()
            changed = set(self.feature_bank)
        written = store.write(self.feature_bank, changed, server_round)
        self._bank_changed, self._bank_on_disk = set(), True
        return written

    def load_feature_bank(self, store: FeatureBankStore, server_round: int) -> None:
        """The bank of the server checkpoint of ``server_round`` (newer entries are dropped)."""
        store.read(server_round, into=self.feature_bank)
        self._bank_changed, self._bank_on_disk = set(), True

    def state_dict(self) -> dict:
        """Everything but the feature bank (:meth:`save_feature_bank`, fedst/methods/feature_bank.py)."""
        return {
            "synthetic_model": self.synthetic_model.state_dict(),
            "domain_descriptor": self.domain_descriptor.detach().cpu(),
            "pre_optimizer": self.pre_optimizer.state_dict(),
            "descriptor_optimizer": self.descriptor_optimizer.state_dict(),
            "global_optimizer": None
            if self.global_optimizer is None
            else self.global_optimizer.state_dict(),
            "stream": self.stream.state_dict(),
            "pretrained_iters": self.pretrained_iters,
            "scalers": {
                name: scaler.state_dict()
                for name, scaler in (("pre", self.pre_scaler), ("global", self.global_scaler))
                if scaler is not None
            },
        }

    def load_state_dict(self, state: dict, global_model: nn.Module) -> None:
        """:meth:`state_dict`'s state; the bank is loaded by :meth:`load_feature_bank`, except
        from a checkpoint written before the bank had its own files (its ``feature_bank``)."""
        self.synthetic_model.load_state_dict(state["synthetic_model"])
        with torch.no_grad():
            self.domain_descriptor.copy_(state["domain_descriptor"])
        if "feature_bank" in state:
            self.feature_bank.clear()
            self.feature_bank.update(state["feature_bank"])
            self._bank_changed, self._bank_on_disk = set(), False
        self.pre_optimizer.load_state_dict(state["pre_optimizer"])
        if self.channels_last:
            match_parameter_layouts(self.pre_optimizer)
        self.descriptor_optimizer.load_state_dict(state["descriptor_optimizer"])
        if state["global_optimizer"] is not None:
            self.global_optimizer = self._global_adam(global_model)
            self.global_optimizer.load_state_dict(state["global_optimizer"])
        self.stream.load_state_dict(state["stream"])
        self.pretrained_iters = state["pretrained_iters"]
        scalers = state.get("scalers", {})
        for name, scaler in (("pre", self.pre_scaler), ("global", self.global_scaler)):
            if scaler is not None and name in scalers:
                scaler.load_state_dict(scalers[name])


class SerqStep:
    """SERQ as FedST's server step (``Method.server_step``, fedst/methods/server_step.py): the
    :class:`Serq` state in the method's checkpoint entry, its feature bank in the run directory
    (``checkpoints/feature_bank/``, fedst/methods/feature_bank.py), v_pre pre-trained here."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        context: ServerContext,
        indicator: torch.Tensor | None,
        loss_fn: SegmentationLoss,
        feature_stage: int,
        method_name: str,
    ) -> None:
        self.global_model = context.global_model
        self.progress = context.progress
        self.store = FeatureBankStore(context.run_dir / FEATURE_BANK_DIR)
        stream, reference = synthetic_stream(cfg, method_name, context.device, cfg.serq.batch_size)
        self.serq = Serq(
            cfg.serq,
            synthetic_model=copy.deepcopy(context.global_model),
            stream=stream,
            reference=reference,
            indicator=indicator,
            loss_fn=loss_fn,
            device=context.device,
            feature_stage=feature_stage,
            precision=context.precision,
            feature_bank=(
                DiskFeatureBank(context.run_dir / SERQ_BANK_SCRATCH)
                if cfg.serq.bank_storage == "disk"
                else {}
            ),
            compile_mode=cfg.train.compile,
            channels_last=cfg.train.channels_last,
        )

    def pretrain(self, iters: int) -> PretrainResult:
        """v_pre^0 trained on the synthetic set, which is also v_g^0 (Algorithm 1, line 3)."""
        result = self.serq.pretrain(iters, progress=self.progress)
        self.global_model.load_state_dict(self.serq.synthetic_model.state_dict())
        return result

    def step(self, global_model: FedSTNet, server_round: int) -> dict[str, Any]:
        """SERQ-EQ then SERQ-SC (or the fine-tuning of ``serq.mode=finetune``): SerqRoundStats."""
        return dict(vars(self.serq.step(global_model)))

    def state_dict(self) -> dict[str, Any]:
        return self.serq.state_dict()

    def load_state_dict(self, state: dict[str, Any], server_round: int) -> None:
        self.serq.load_state_dict(state, self.global_model)
        if "feature_bank" not in state:  # the bank has files of its own (not an old checkpoint)
            self.serq.load_feature_bank(self.store, server_round)

    def save_files(self, server_round: int) -> StepFiles:
        written = self.serq.save_feature_bank(self.store, server_round)
        return StepFiles(bytes=written.bytes, files=written.files)

    def prune_files(self, server_round: int, previous_round: int | None) -> None:
        self.store.prune(server_round, previous_round)

    def close(self) -> None:
        """Release SERQ's scratch bank file (``serq.bank_storage=disk``)."""
        if isinstance(self.serq.feature_bank, DiskFeatureBank):
            self.serq.feature_bank.close()


def _sum(log: LossLog) -> float:
    """The sum of a round's per-batch scalars, in batch order (one host sync)."""
    return sum(log.values(), 0.0)


def _occurrences(ids: list[str]) -> list[list[int]]:
    """Positions of ``ids`` in waves: the first occurrence of every id, then the second ones,
    and so on (one wave when no id repeats)."""
    seen: dict[str, int] = {}
    waves: list[list[int]] = []
    for position, sample_id in enumerate(ids):
        k = seen.get(sample_id, 0)
        seen[sample_id] = k + 1
        if k == len(waves):
            waves.append([])
        waves[k].append(position)
    return waves

"""Positive control for the temporal module (issue 47, point 1): does TS read the clip's own past?

    .venv/bin/python -m studies.temporal_control.temporal_control                      # 3 seeds, the protocol's size
    .venv/bin/python -m studies.temporal_control.temporal_control --oracles-only       # the data oracles, no model
    .venv/bin/python -m studies.temporal_control.temporal_control --seeds 0 --steps 200 --data-root /tmp/demo_v2

Every clip's **current frame is made uninformative**: its pixels are replaced by the mean colour of
the clip's earlier frames (:func:`blank_current_frame`; nothing of frame t is left), while its
label is kept and the earlier frames t-1..t-3 are intact. Only the clip's own past can then say
where the instruments are. One network (FedST's, ``method.build_model()``, with prompt and channel
selection off: Table IV row 2's network, so no site indicator is involved) is trained centrally on
the pooled training clips of sites A-D of the demo benchmark (generator v2, 128x160) with the
project's clip loader (:class:`fedst.data.clips.BatchStream`) and loss (Eq. 9,
``method.segmentation_loss()``), and scored on A-D's test clips (Dice of the part classes,
:class:`fedst.scoring.metrics.SegmentationMeter`). The arms:

* ``own_history`` (a): TS on, each test clip with its own earlier frames;
* ``single_frame`` (b): the single-frame network (``method.temporal=false``: no temporal module,
  ``forward`` reads only the current frame), trained and scored the same way;
* ``other_history`` (c): the network of (a), each test clip replaced by the clip of another video
  of the same site at the same position (:func:`other_video_partners`), scored against the
  original label. A network that reads its own past follows the other video's instruments and
  falls; one whose score came from something else (a site prior, a leak of frame t) would not.
  This is the same trained model as (a), so the only change is the history it is given. A TS
  network *trained* on other videos' history is not an arm: its history carries nothing about the
  target, so it can learn no more than the single-frame network's site prior, i.e. it repeats (b)
  at the cost of a TS training per seed.

Only clips whose three earlier frames are real earlier frames are used (:func:`with_full_history`):
at a video's start the clip builder repeats the current frame, which here would hand the
uncorrupted current frame to the history.

The data oracles (:func:`data_oracles`, no model) bound what the arms can reach: ``copy t-1``
predicts frame t's label by the latest labelled earlier frame of the clip (t-1; site C, labelled
every 2nd frame, t-2), ``copy t-1 at 16 px`` the same label reduced to the 2 x 2 stride-8 cells
(16 px) of one t-1 context token of the windowed module (Eq. 3, p = 2) by majority, ``copy t-1
at the CFFM module's t-1 tokens`` the same by the CFFM module's geometry (:func:`cffm_token_label`:
3 tokens per 7-cell window, 18.67 px), and ``site prior`` the best
fixed mask per site (per-pixel class frequencies of the site's training labels, foreground where
their sum reaches the threshold that maximises training Dice): what a network that sees only the
site's mean colour can know.

Writes ``<out>/temporal_control.json`` and ``.md`` (per arm and seed Dice, mean +- std, wall
times, the CPU) and prints the table. studies/temporal_control/README.md ("A positive control for the temporal
module") holds the protocol and the measured table.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedst.cli import compose_experiment
from fedst.data.clips import BatchStream, ClipDataset, current_frame_masks
from fedst.data.procedural import generate
from fedst.experiment import ExperimentConfig
from fedst.methods import method_of
from fedst.methods.optimizer import lr_factor, param_groups, set_lr_factor
from fedst.model.losses import clip_frame_loss
from fedst.model.network import FedSTNet
from fedst.scoring.metrics import SegmentationMeter
from fedst.scoring.site_data import PooledClips, open_site_data
from fedst.seeding import seed_everything
from fedst.training import BENCHMARK_SEED

ARMS = ("own_history", "single_frame", "other_history")
"""The protocol's arms (its rule reads these three)."""
STUDY_ARMS = (*ARMS, "reference_reader")
"""With the reference reader (:class:`HistoryConcatReader`): an upper bound for this backbone and
budget, a study arm (``--arms``), not a method."""
SITES = ("A", "B", "C", "D")
TOKEN_PIXELS = 16
"""Side in pixels, at 128x160, of one t-1 context token of TS: p = 2 cells of the stride-8 map."""
DEFAULT_STEPS = 600
EVAL_BATCH = 8


@dataclass(frozen=True)
class Threshold:
    """The pass rule stated before any run (studies/temporal_control/README.md): Dice in % of the part classes."""

    own_history_min: float = 40.0
    """(a) at least this."""
    margin: float = 25.0
    """(a) at least this far above (b) and above (c)."""

    def failures(self, dice: dict[str, float]) -> list[str]:
        """What ``dice`` (arm -> Dice %) breaks of the rule; empty when it holds."""
        own = dice["own_history"]
        broken = []
        if own < self.own_history_min:
            broken.append(f"(a) own_history {own:.2f} < {self.own_history_min}")
        for other in ("single_frame", "other_history"):
            if other in dice and own < dice[other] + self.margin:
                broken.append(f"(a) {own:.2f} < {other} {dice[other]:.2f} + {self.margin}")
        return broken


THRESHOLD = Threshold()


# -- data ---------------------------------------------------------------------------------------


def experiment_config(
    data_root: Path, seed: int, temporal: bool, overrides: Sequence[str] = ()
) -> ExperimentConfig:
    """The demo experiment, pooled A-D (the upper bound's party), TS on or off, no prompt / CS.

    ``network.detach_previous_frames=false``: with the current frame blank the encoder learns only
    through the earlier frames; the demo's no-gradient history would leave it at its random init.
    """
    cfg, _ = compose_experiment(
        [
            "experiment=demo",
            "method=upperbound",
            f"method.temporal={str(temporal).lower()}",
            f"data.root={data_root}",
            "network.detach_previous_frames=false",
            f"seed={seed}",
            *overrides,
        ]
    )
    return cfg


def has_full_history(dataset: ClipDataset, index: int) -> bool:
    """True when sample ``index``'s earlier frames are real, distinct, earlier frames."""
    video, position = dataset.sample_ref(index)
    positions = dataset.clip_positions(video, position)
    return all(a < b for a, b in itertools.pairwise(positions))  # strictly increasing


def with_full_history(dataset: ClipDataset) -> ClipDataset:
    """A shallow copy of ``dataset`` holding only the samples of :func:`has_full_history`."""
    kept = [s for i, s in enumerate(dataset.samples) if has_full_history(dataset, i)]
    subset = copy.copy(dataset)
    subset.samples, subset.num_samples, subset._index_of_id = kept, len(kept), None
    return subset


def open_clips(cfg: ExperimentConfig) -> tuple[PooledClips, dict[str, ClipDataset]]:
    """(pooled A-D training clips with augmentation, {site: test clips}), full history only."""
    train = [with_full_history(open_site_data(cfg, s, ("train",)).train) for s in SITES]
    tests = {s: with_full_history(open_site_data(cfg, s, ("test",)).test) for s in SITES}
    return PooledClips(train), tests


def blank_current_frame(clips: torch.Tensor) -> torch.Tensor:
    """clips [B, T, 3, H, W] -> a copy whose current (last) frame is the per-channel mean colour of
    the clip's earlier frames, constant over the image: nothing of frame t is left."""
    blanked = clips.clone()
    blanked[:, -1] = clips[:, :-1].mean(dim=(1, 3, 4), keepdim=True)[:, 0]  # [B, 3, 1, 1]
    return blanked


def other_video_partners(dataset: ClipDataset) -> list[int]:
    """For each sample, a sample of another video of the same site at the nearest position.

    The site's videos are taken in a cycle (video v's partner is video v + 1), so every sample gets
    another video's clip whose background matches its own. Needs two videos or more.
    """
    by_video: dict[int, list[tuple[int, int]]] = {}  # video index -> [(position, sample index)]
    for index, (video_index, position) in enumerate(dataset.samples):
        by_video.setdefault(video_index, []).append((position, index))
    videos = sorted(by_video)
    if len(videos) < 2:
        raise ValueError(f"site {dataset.site_name}: another video's history needs >= 2 videos")
    partners = []
    for video_index, position in dataset.samples:
        other = videos[(videos.index(video_index) + 1) % len(videos)]
        partners.append(min(by_video[other], key=lambda item: abs(item[0] - position))[1])
    return partners


# -- training and scoring -----------------------------------------------------------------------


class HistoryConcatReader(nn.Module):
    """A plain temporal reader: at every encoder stage, the T frames' maps concatenated and fused
    by a 1x1 convolution into the current frame's map (``F_s + conv([F_s^{t-3}, ..., F_s^t])``),
    then the network's decoder. ``net`` is the single-frame network (no temporal module); its
    encoder reads every frame with gradient. clips [B, T, 3, H, W] -> logits [B, K, H, W]."""

    def __init__(
        self,
        net: FedSTNet,
        num_frames: int,
        stages: Sequence[int] = (0, 1, 2, 3),
        tokens_per_window: Sequence[int] | None = None,
    ):
        super().__init__()
        self.net = net
        self.stages = tuple(stages)
        self.tokens_per_window = None if tokens_per_window is None else tuple(tokens_per_window)
        if self.tokens_per_window is not None and len(self.tokens_per_window) != num_frames - 1:
            raise ValueError(
                f"HistoryConcatReader: tokens_per_window {self.tokens_per_window} needs one "
                f"entry per earlier frame ({num_frames - 1})"
            )
        dims = tuple(net.encoder.embed_dims)
        self.history_fusion = nn.ModuleDict(
            {str(s): nn.Conv2d(num_frames * dims[s], dims[s], 1) for s in self.stages}
        )

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        batch, num_frames = clips.shape[:2]
        feats = self.net.encoder(clips.flatten(0, 1))  # 4 x [B*T, C, h, w]
        fused = []
        for stage, feat in enumerate(feats):
            frames = feat.unflatten(0, (batch, num_frames))  # [B, T, C, h, w]
            current = frames[:, -1]  # [B, C, h, w]
            if stage in self.stages and self.tokens_per_window is not None:
                frames = self._at_module_tokens(frames)
            if stage in self.stages:
                current = current + self.history_fusion[str(stage)](frames.flatten(1, 2))
            fused.append(current)
        return self.net._decode(fused, {}, None, (clips.shape[3], clips.shape[4]))

    def _at_module_tokens(self, frames: torch.Tensor) -> torch.Tensor:
        """[B, T, C, h, w] -> the same with each earlier frame reduced to what the CFFM module's
        pooled tokens hold of it: zero-padded to whole windows, averaged over ``l x l`` tokens per
        window (``tokens_per_window``, oldest first) and spread back over their cells."""
        window = self.net.cfg.window_size
        height, width = frames.shape[-2:]
        padded_h, padded_w = -(-height // window) * window, -(-width // window) * window
        reduced = []
        for f, tokens in enumerate(self.tokens_per_window):
            frame = F.pad(frames[:, f], (0, padded_w - width, 0, padded_h - height))
            grid = (padded_h // window * tokens, padded_w // window * tokens)
            pooled = F.adaptive_avg_pool2d(frame, grid)  # [B, C, tokens_h, tokens_w]
            spread = F.interpolate(pooled, size=(padded_h, padded_w), mode="nearest")
            reduced.append(spread[..., :height, :width])
        return torch.stack([*reduced, frames[:, -1]], dim=1)


def train_network(
    cfg: ExperimentConfig,
    train: PooledClips,
    steps: int,
    model: nn.Module | None = None,
    curve: Callable[[int, nn.Module], None] | None = None,
    curve_every: int = 0,
) -> tuple[nn.Module, float]:
    """``steps`` AdamW steps of Eq. 9 on blanked clips -> (model in eval mode, wall seconds).

    The optimizer is a site's (fedst/methods/optimizer.py: the temporal module's lr multiplier,
    no decay on norms, the schedule over ``steps``). With ``train.clip_frame_loss_weight`` > 0
    and a temporal network the loss adds, as a site's (``Method.clip_frame_term``), the weight x
    L_seg of every clip frame's own prediction (the blanked current frame's included, as CFFM
    supervises all T frames); the single-frame and reference-reader arms train on the current
    frame only. ``model``: another network than the method's (the reference reader);
    ``curve(step, model)`` is called every ``curve_every`` steps."""
    method = method_of(cfg)
    model = method.build_model() if model is None else model
    loss_fn = method.segmentation_loss()
    schedule = dataclasses.replace(cfg.train, total_iters=steps)
    optimizer = torch.optim.AdamW(
        param_groups(model.named_parameters(), cfg.train),
        lr=cfg.train.lr,
        weight_decay=cfg.train.weight_decay,
    )
    stream = BatchStream(
        train, batch_size=cfg.train.batch_size, seed=cfg.seed, num_classes=cfg.network.num_classes
    )
    seed_everything(cfg.seed, 47)
    model.train()
    started = time.perf_counter()
    frame_weight = method.clip_frame_loss_weight if isinstance(model, FedSTNet) else 0.0
    for step in range(steps):
        set_lr_factor(optimizer, lr_factor(step, schedule))
        clips, batch_masks, _ = stream.next_batch()  # [B, T, 3, H, W], [B, H, W] | [B, T, H, W]
        masks = current_frame_masks(batch_masks)  # [B, H, W]
        if frame_weight > 0:  # CFFM: + weight x L_seg of every clip frame's own prediction
            logits, frame_logits = model(blank_current_frame(clips), return_frame_logits=True)
            frame_term = frame_weight * clip_frame_loss(loss_fn, frame_logits, batch_masks)
            loss = loss_fn(logits, masks) + frame_term
        else:
            logits = model(blank_current_frame(clips))  # [B, K, H, W]
            loss = loss_fn(logits, masks)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        done = step + 1
        if curve is not None and curve_every and done % curve_every == 0 and done < steps:
            curve(done, model.eval())  # the final step is scored by the caller
            model.train()
    stream.close()
    return model.eval(), time.perf_counter() - started


@torch.no_grad()
def score(model: FedSTNet, tests: dict[str, ClipDataset], other_history: bool = False) -> float:
    """Dice (%) of the part classes over every test clip of ``tests``, current frames blanked.

    ``other_history``: each clip is replaced by its :func:`other_video_partners` clip (arm c).
    """
    meter = SegmentationMeter(distances=False)
    for dataset in tests.values():
        sources = other_video_partners(dataset) if other_history else range(len(dataset))
        for start in range(0, len(dataset), EVAL_BATCH):
            batch = range(start, min(start + EVAL_BATCH, len(dataset)))
            clips = torch.stack([dataset[sources[i]][0] for i in batch])  # [b, T, 3, H, W]
            masks = torch.stack([dataset[i][1] for i in batch])  # [b, H, W]
            meter.update(model(blank_current_frame(clips)).argmax(1), masks)
    return meter.summary()["dice"] or 0.0


# -- data oracles (no model) --------------------------------------------------------------------


def _current_and_earlier_labels(dataset: ClipDataset, index: int) -> tuple[np.ndarray, np.ndarray]:
    """(label of the current frame, label of the latest labelled earlier frame of the clip)."""
    video, position = dataset.sample_ref(index)
    earlier = [p for p in dataset.clip_positions(video, position)[:-1] if p in video.labels]
    read = dataset.source.read_label
    return read(video.labels[position]), read(video.labels[earlier[-1]])


def coarse_label(label: np.ndarray, cell: int = TOKEN_PIXELS, num_classes: int = 4) -> np.ndarray:
    """label [H, W] -> the majority class of each ``cell x cell`` block, at [H, W] (255 as 0)."""
    classes = torch.from_numpy(np.where(label == 255, 0, label).astype(np.int64))
    one_hot = F.one_hot(classes, num_classes).permute(2, 0, 1).float()[None]  # [1, K, H, W]
    votes = F.avg_pool2d(one_hot, cell, ceil_mode=True)  # [1, K, H/cell, W/cell]
    majority = F.interpolate(votes, scale_factor=cell, mode="nearest").argmax(1)[0]
    return majority[: label.shape[0], : label.shape[1]].numpy()


def cffm_token_label(
    label: np.ndarray,
    tokens_per_window: int,
    cell_pixels: int = 8,
    window: int = 7,
    num_classes: int = 4,
) -> np.ndarray:
    """label [H, W] -> the majority class of each pooled token of an earlier frame in the CFFM
    module's geometry, at [H, W]: the map is zero-padded to whole windows of ``window`` cells of
    ``cell_pixels`` px, as the module pads, and each window holds ``tokens_per_window`` tokens per
    side (t-1: 3, so a token spans 56 / 3 = 18.67 px at stride 8). Votes are area averages."""
    height, width = label.shape
    window_pixels = cell_pixels * window
    padded_h, padded_w = (
        -(-height // window_pixels) * window_pixels,
        -(-width // window_pixels) * window_pixels,
    )
    classes = torch.from_numpy(np.where(label == 255, 0, label).astype(np.int64))
    one_hot = F.one_hot(classes, num_classes).permute(2, 0, 1).float()[None]  # [1, K, H, W]
    one_hot = F.pad(one_hot, (0, padded_w - width, 0, padded_h - height))  # padding: no class
    tokens = (
        padded_h // window_pixels * tokens_per_window,
        padded_w // window_pixels * tokens_per_window,
    )
    votes = F.interpolate(one_hot, size=tokens, mode="area")  # [1, K, tokens_h, tokens_w]
    majority = F.interpolate(votes, size=(padded_h, padded_w), mode="nearest").argmax(1)[0]
    return majority[:height, :width].numpy()


def site_prior(train: ClipDataset, test: ClipDataset) -> float:
    """Dice (%) on ``test`` of the best fixed mask learnt from ``train``'s labels (no images)."""
    labels = np.stack([_current_and_earlier_labels(train, i)[0] for i in range(len(train))])
    frequency = np.stack([(labels == c).mean(0) for c in range(4)])  # [K, H, W]
    parts = frequency[1:].argmax(0) + 1  # most frequent part where instrument is predicted

    def prior_dice(labelled: np.ndarray, threshold: float) -> float:
        fixed = np.where(frequency[1:].sum(0) >= threshold, parts, 0)
        meter = SegmentationMeter(distances=False)
        meter.update(np.broadcast_to(fixed, labelled.shape).copy(), labelled)
        return meter.summary()["dice"] or 0.0

    best = max(np.arange(0.05, 0.95, 0.05), key=lambda t: prior_dice(labels, float(t)))
    tests = np.stack([_current_and_earlier_labels(test, i)[0] for i in range(len(test))])
    return prior_dice(tests, float(best))


def data_oracles(cfg: ExperimentConfig) -> dict[str, float]:
    """Dice (%) on A-D's test clips of copying the earlier label, at full and token resolution, and
    of the per-site prior (mean over sites, frames pooled for the copies)."""
    meters = {
        name: SegmentationMeter(distances=False)
        for name in (
            "copy t-1",
            f"copy t-1 at {TOKEN_PIXELS} px",
            "copy t-1 at the CFFM module's t-1 tokens (18.67 px)",
            "copy another video's t-1",
        )
    }
    copy_full, copy_coarse, copy_cffm, copy_other = meters.values()
    network = cfg.network  # the CFFM module's t-1 tokens at its stage (stride 4 x 2^stage)
    t1_geometry = {
        "tokens_per_window": network.temporal_tokens_per_window[-1],
        "cell_pixels": 4 * 2 ** network.temporal_stages[0],
        "window": network.window_size,
    }
    priors = []
    for site in SITES:
        data = open_site_data(cfg, site, ("train", "test"))
        train, test = with_full_history(data.train), with_full_history(data.test)
        partners = other_video_partners(test)
        for i in range(len(test)):
            now, before = _current_and_earlier_labels(test, i)
            copy_full.update(before[None], now[None])
            copy_coarse.update(coarse_label(before)[None], now[None])
            copy_cffm.update(cffm_token_label(before, **t1_geometry)[None], now[None])
            copy_other.update(_current_and_earlier_labels(test, partners[i])[1][None], now[None])
        priors.append(site_prior(train, test))
    oracles = {name: meter.summary()["dice"] for name, meter in meters.items()}
    return {**oracles, "site prior (mean of A-D)": float(np.mean(priors))}


# -- the benchmark ------------------------------------------------------------------------------


def run_seed(
    data_root: Path,
    seed: int,
    steps: int,
    arms: Sequence[str],
    overrides: Sequence[str] = (),
    curve_every: int = 0,
    reader_stages: Sequence[int] = (0, 1, 2, 3),
    reader_tokens: Sequence[int] | None = None,
) -> dict[str, dict]:
    """Train and score the ``arms`` at one seed: arm -> {"dice", "train_s", "curve"}, where
    ``curve`` lists [step, Dice %] every ``curve_every`` steps and at the last. ``overrides``:
    Hydra overrides of every arm's experiment (e.g. ``network.temporal_variant=windowed``)."""
    temporal_cfg = experiment_config(data_root, seed, True, overrides)
    single_cfg = experiment_config(data_root, seed, False, overrides)
    train, tests = open_clips(temporal_cfg)  # 4-frame clips for every arm
    results: dict[str, dict] = {}

    def trained(cfg: ExperimentConfig, arm: str, model: nn.Module | None = None) -> nn.Module:
        curve: list[list[float]] = []
        model, seconds = train_network(
            cfg, train, steps, model, lambda step, m: curve.append([step, score(m, tests)]),
            curve_every,
        )  # fmt: skip
        results[arm] = {"dice": score(model, tests), "train_s": seconds, "curve": curve}
        results[arm]["curve"].append([steps, results[arm]["dice"]])
        return model

    if "own_history" in arms or "other_history" in arms:
        model = trained(temporal_cfg, "own_history")
        if "other_history" in arms:
            own = results["own_history"]
            results["other_history"] = {
                "dice": score(model, tests, other_history=True),
                "train_s": own["train_s"],
                "curve": [],  # the own-history network, scored once on other videos' history
            }
        if "own_history" not in arms:
            del results["own_history"]
    if "single_frame" in arms:
        trained(single_cfg, "single_frame")
    if "reference_reader" in arms:
        seed_everything(seed, 58)
        reader = HistoryConcatReader(
            method_of(single_cfg).build_model(), 4, reader_stages, reader_tokens
        )
        trained(single_cfg, "reference_reader", reader)
    return results


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def markdown(per_seed: dict[int, dict[str, dict]], oracles: dict[str, float] | None) -> str:
    """The arms x seeds table (Dice %, mean +- std) and the oracles."""
    seeds = sorted(per_seed)
    arms = [a for a in STUDY_ARMS if any(a in per_seed[s] for s in seeds)]
    lines = [
        "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± std | train s (mean) |",
        "|---|" + "---:|" * (len(seeds) + 2),
    ]
    for arm in arms:
        values = [per_seed[s][arm]["dice"] for s in seeds]
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        train_s = statistics.mean(per_seed[s][arm]["train_s"] for s in seeds)
        cells = " | ".join(f"{v:.2f}" for v in values)
        lines.append(
            f"| {arm} | {cells} | {statistics.mean(values):.2f} ± {spread:.2f} | {train_s:.0f} |"
        )
    if oracles:
        lines += ["", "| data oracle (no model) | Dice % |", "|---|---:|"]
        lines += [f"| {name} | {value:.2f} |" for name, value in oracles.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-root", type=Path, default=Path("data/procedural/demo_v2"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--oracles-only", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("runs/temporal_control"))
    parser.add_argument(
        "--arms", nargs="+", choices=STUDY_ARMS, default=list(ARMS), help="arms to train"
    )
    parser.add_argument(
        "--curve-every", type=int, default=150, help="score the arms every k steps (0: last only)"
    )
    parser.add_argument(
        "--reader-stages",
        type=int,
        nargs="+",
        default=[0, 1, 2, 3],
        help="encoder stages where the reference reader fuses the history (default: all)",
    )
    parser.add_argument(
        "--reader-tokens",
        type=int,
        nargs="+",
        default=None,
        help="the reader sees each earlier frame only as the CFFM module's pooled tokens, l per "
        "window side, oldest first (e.g. 1 2 3 with --reader-stages 1: the module's geometry)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides of every arm, e.g. network.temporal_variant=windowed",
    )
    args = parser.parse_args(argv)

    started = time.perf_counter()
    generate(args.data_root, BENCHMARK_SEED, "demo", progress=False)  # no-op when present
    oracles = data_oracles(experiment_config(args.data_root, 0, temporal=True))
    if args.oracles_only:
        print("\n".join(f"{name}: {value:.2f}" for name, value in oracles.items()))
        return 0
    arms = [a for a in STUDY_ARMS if a in args.arms]
    per_seed = {}
    for seed in args.seeds:
        per_seed[seed] = run_seed(
            args.data_root,
            seed,
            args.steps,
            arms,
            args.overrides,
            args.curve_every,
            args.reader_stages,
            args.reader_tokens,
        )
        print(
            f"seed {seed}: "
            + json.dumps({a: round(r["dice"], 2) for a, r in per_seed[seed].items()})
        )
    table = markdown(per_seed, oracles)
    means = {a: statistics.mean(per_seed[s][a]["dice"] for s in per_seed) for a in arms}
    verdict = THRESHOLD.failures(means) if "own_history" in means else ["(a) not run"]
    report = {
        "per_seed": per_seed,
        "oracles": oracles,
        "threshold": dataclasses.asdict(THRESHOLD),
        "passed": not verdict,
        "failures": verdict,
        "steps": args.steps,
        "overrides": args.overrides,
        "reader_stages": args.reader_stages,
        "reader_tokens": args.reader_tokens,
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "wall_s": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "temporal_control.json").write_text(json.dumps(report, indent=2))
    (args.out / "temporal_control.md").write_text(table + "\n")
    print(table)
    print(f"threshold on the means: {'passed' if not verdict else 'FAILED: ' + '; '.join(verdict)}")
    print(f"{report['cpu']}, {report['threads']} thread(s), {report['wall_s']:.0f} s wall")
    return 0 if not verdict else 1


if __name__ == "__main__":
    raise SystemExit(main())

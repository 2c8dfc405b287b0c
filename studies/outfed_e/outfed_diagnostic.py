"""Why does FedST's model fall behind on an unseen site? Inference-time probes of one run (issue 37).

    python -m studies.outfed_e.outfed_diagnostic RUN [--fedavg FEDAVG_RUN] [--sites E grasp] [--out DIR]

Every row changes one thing in the run's out-of-federation model (fedst/runs/outfed.py) and scores it
on each out-of-federation site's test split: Dice (%, fedst.scoring.evaluation.evaluate_model,
the numbers the run reports) and the background-as-instrument rate (% of the site's true
background pixels, at native resolution, predicted as any instrument part), from a second pass
that counts the pixel confusion matrix. Rows (studies/outfed_e/README.md):

* ``average, rule own | fold | mean``: the averaged model under each ``indicator.unseen`` rule
  (own: the site's own indicator, e.g. E's one-hot column that no site trained);
* ``average, input zeros | xi_A ...``: the plain average (rule own) given another indicator;
* ``v_k, own xi``: each federated site's returned model with its own indicator;
* ``rho_k + mean gamma``: site k's private part with the sample-weighted mean of the gamma_k;
* ``server gamma_g (post-SERQ)``: the fold model's shared part replaced by the server's gamma_g;
* ``fold, static clip`` / ``fold, t-3 t-2 masked`` / ``fold, earlier frames masked``: the temporal
  module given the current frame's features for every frame, or with the context slots of those
  frames masked out of the attention (only the current window's slots stay);
* ``fold, gate = sites' mean``: every channel-selection gate fixed to the constant
  sum_k n_k / n mean gate that v_k gives on site k's own test split.

``--only-returned``: the run's out-of-federation model alone (a control's row). With
``--fedavg``: that run's out-of-federation model as one more row, and the pixel confusion
matrices (rows: true class, columns: predicted, % of the row) of FedST's rule-own and rule-fold
models and FedAvg's on each site. Writes ``<out>/diagnostic.json`` and ``<out>/diagnostic.md``
(default out: ``RUN/diagnostic``) and prints the markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fedst.accel import resolve_device
from fedst.experiment import ExperimentConfig
from fedst.model.channel_selection import ChannelSelection
from fedst.model.network import FedSTNet
from fedst.model.state import load_subset
from fedst.model.temporal import TemporalCrossAttention
from fedst.runs import Run
from fedst.runs.returned import (
    build_returned_model,
    returned_shared,
    site_model,
    weighted_by_samples,
)
from fedst.scoring.evaluation import evaluate_model, native_class_map, predict_test_frames
from fedst.scoring.site_data import open_site_data

log = logging.getLogger("outfed_diagnostic")

IGNORE = 255
Hook = Callable[[FedSTNet], contextlib.AbstractContextManager]


@dataclass
class Probe:
    """One row: a model, the indicator it is given, and an optional change made while it runs."""

    label: str
    model: FedSTNet
    indicator: torch.Tensor | None
    hook: Hook | None = None


def with_rule(cfg: ExperimentConfig, rule: str) -> ExperimentConfig:
    """``cfg`` with ``indicator.unseen=rule``."""
    return dataclasses.replace(cfg, indicator=dataclasses.replace(cfg.indicator, unseen=rule))


# -- changes made while a model runs ------------------------------------------------------------


@contextlib.contextmanager
def static_clips(model: FedSTNet) -> Iterator[None]:
    """Every temporal module gets the current frame's map for every frame (a static clip)."""
    modules = [m for m in model.modules() if isinstance(m, TemporalCrossAttention)]
    for module in modules:
        original = module.forward
        module.forward = lambda frames, _f=original: _f([frames[-1]] * len(frames))  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module in modules:
            del module.forward


def masked_frames(frames: tuple[int, ...]) -> Hook:
    """A hook masking the context slots of ``frames`` (0 = t-3, oldest) out of the attention."""

    @contextlib.contextmanager
    def hook(model: FedSTNet) -> Iterator[None]:
        modules = [m for m in model.modules() if isinstance(m, TemporalCrossAttention)]
        for module in modules:
            original = module.context_layout

            def layout(h, w, device, _m=module, _f=original):
                index, valid = _f(h, w, device)
                keep = torch.ones_like(valid)
                start = 0
                for f, n in enumerate(_m.tokens_per_side):
                    if f in frames:
                        keep[:, start : start + n * n] = False
                    start += n * n
                return index, valid & keep

            module.context_layout = layout  # type: ignore[method-assign]
        try:
            yield
        finally:
            for module in modules:
                del module.context_layout

    return hook


def fixed_gate(gates: dict[str, torch.Tensor]) -> Hook:
    """A hook fixing channel selection ``name``'s gate to the constant ``gates[name]`` [C]."""

    @contextlib.contextmanager
    def hook(model: FedSTNet) -> Iterator[None]:
        modules = dict(model.channel_selection.items())
        for name, module in modules.items():
            gate = gates[name]
            module.gate = lambda feat, ind, _g=gate: _g.to(feat).expand(feat.shape[0], -1)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for module in modules.values():
                del module.gate

    return hook


@torch.no_grad()
def mean_gates(model: FedSTNet, dataset, indicator, device) -> dict[str, torch.Tensor]:
    """The mean gate [C] of each channel-selection module of ``model`` over ``dataset``."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    originals = {}
    for name, module in model.channel_selection.items():
        if not isinstance(module, ChannelSelection):
            raise SystemExit(f"channel_selection.{name} is not FedST's ChannelSelection")
        originals[name] = module.gate

        def recording(feat, ind, _n=name, _f=module.gate):
            gate = _f(feat, ind)  # [B, C]
            sums[_n] = sums.get(_n, 0) + gate.double().sum(0)
            counts[_n] = counts.get(_n, 0) + gate.shape[0]
            return gate

        module.gate = recording  # type: ignore[method-assign]
    try:
        for _ in predict_test_frames(model, dataset, indicator, device):
            pass
    finally:
        for module in model.channel_selection.values():
            del module.gate
    return {name: (sums[name] / counts[name]).float() for name in sums}


# -- the rows -------------------------------------------------------------------------------------


def fedst_probes(run: Run, device: torch.device) -> Iterator[Probe]:
    """The rows of one FedST-like run (module docstring), built lazily, one model at a time."""
    cfg, method = run.cfg, run.method
    indicators = method.indicators()
    federation = list(cfg.data.federation)
    dim = cfg.indicator.dim
    zeros = torch.zeros(dim)
    states = {s: run.site_state(s) for s in federation}
    global_shared = run.global_shared()
    own = run.with_config(with_rule(cfg, "own"))
    for rule in ("own", "fold", "mean"):
        # an own-rule model reads the scored site's indicator: None = "the site's own"
        model = run.with_config(with_rule(cfg, rule)).outfed_model(device)
        yield Probe(f"average, rule {rule}", model, None)
    plain = own.outfed_model(device)
    yield Probe("average, input zeros", plain, zeros)
    for site in federation:
        yield Probe(f"average, input xi_{site}", plain, indicators[site])
    for site in federation:
        yield Probe(
            f"v_{site}, own xi",
            site_model(own.method, states[site], global_shared, device),
            indicators[site],
        )
    shared_states = [
        dataclasses.replace(st, shared=returned_shared(method, st, global_shared))
        for st in states.values()
    ]
    mean_gamma = weighted_by_samples(shared_states, "shared")
    for site in federation:
        model = build_returned_model(method, mean_gamma, states[site].personal, device)
        yield Probe(f"rho_{site} + mean gamma, xi_{site}", model, indicators[site])
    fold = run.with_config(with_rule(cfg, "fold"))
    folded = fold.outfed_model(device)
    if global_shared:
        server = fold.outfed_model(device)
        load_subset(server, dict(global_shared))
        yield Probe("fold, server gamma_g (post-SERQ)", server, zeros)
    if cfg.method.temporal:
        yield Probe("fold, static clip", folded, zeros, static_clips)
        yield Probe("fold, t-3 t-2 masked", folded, zeros, masked_frames((0, 1)))
        yield Probe("fold, earlier frames masked", folded, zeros, masked_frames((0, 1, 2)))
    if cfg.method.channel_selection:
        weights = {s: states[s].num_examples for s in federation}
        total = sum(weights.values())
        gates: dict[str, torch.Tensor] = {}
        for site in federation:
            model = site_model(own.method, states[site], global_shared, device)
            test = open_site_data(cfg, site, ("test",)).test
            for name, gate in mean_gates(model, test, indicators[site].to(device), device).items():
                gates[name] = gates.get(name, 0) + weights[site] / total * gate
        yield Probe("fold, gate = sites' mean", folded, zeros, fixed_gate(gates))


# -- scoring --------------------------------------------------------------------------------------


@torch.no_grad()
def confusion(model: FedSTNet, dataset, indicator, device, num_classes: int) -> torch.Tensor:
    """Pixel counts [true class, predicted class] at native resolution (255 ignored)."""
    counts = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    for prediction in predict_test_frames(model, dataset, indicator, device):
        label = prediction.label.to(device).long()
        predicted = native_class_map(prediction.logits, tuple(label.shape)).long()
        keep = label != IGNORE
        index = label[keep] * num_classes + predicted[keep]
        counts += torch.bincount(index, minlength=num_classes * num_classes).view(num_classes, -1)
    return counts.cpu()


def score(probe: Probe, site: str, data, indicator, device, num_classes: int) -> dict:
    """Dice (the run's metric) and the confusion-derived rates of one row on one site."""
    ind = probe.indicator if probe.indicator is not None else indicator
    ind = ind.to(device) if ind is not None else None
    hook = probe.hook(probe.model) if probe.hook else contextlib.nullcontext()
    with hook:
        summary = evaluate_model(probe.model, data, ind, device, distances=False).summary
        counts = confusion(probe.model, data, ind, device, num_classes)
    background = counts[0].sum().item()
    instrument = counts[1:].sum().item()
    return {
        "dice": summary["dice"],
        "background_as_instrument": 100.0 * counts[0, 1:].sum().item() / max(background, 1),
        "instrument_as_background": 100.0 * counts[1:, 0].sum().item() / max(instrument, 1),
        "confusion": counts.tolist(),
    }


def confusion_table(counts: list[list[int]], names: list[str]) -> str:
    """Markdown: rows true class, columns predicted, % of the row."""
    lines = ["| true \\ predicted | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for name, row in zip(names, counts, strict=False):
        total = max(sum(row), 1)
        if sum(row) == 0:
            continue
        lines.append(f"| {name} | " + " | ".join(f"{100 * v / total:.1f}" for v in row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", type=Path, help="a finished FedST run directory")
    parser.add_argument("--fedavg", type=Path, default=None, help="a FedAvg run to compare with")
    parser.add_argument(
        "--sites", nargs="*", default=None, help="default: the run's out-of-federation sites"
    )
    parser.add_argument("--out", type=Path, default=None, help="default: RUN/diagnostic")
    parser.add_argument(
        "--only-returned",
        action="store_true",
        help="only the run's out-of-federation model under its own rule (a control's one row)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    started = time.perf_counter()
    run = Run(args.run)
    cfg = run.cfg
    device = resolve_device(cfg.train.device)
    sites = args.sites or list(cfg.data.out_of_federation)
    indicators = run.method.indicators()
    num_classes = cfg.network.num_classes
    data = {s: open_site_data(cfg, s, ("test",)).test for s in sites}
    rows: dict[str, dict[str, dict]] = {}
    probes = fedst_probes(run, device)
    if args.only_returned:
        rule = cfg.unseen_indicator_rule() or "none"
        probes = iter([Probe(f"average, rule {rule}", run.outfed_model(device), None)])
    for probe in probes:
        rows[probe.label] = {
            s: score(probe, s, data[s], indicators.get(s), device, num_classes) for s in sites
        }
        print(
            probe.label, {s: round(r["dice"], 2) for s, r in rows[probe.label].items()}, flush=True
        )
    if args.fedavg is not None:
        fedavg = Run(args.fedavg)
        model = fedavg.outfed_model(device)
        fedavg_data = {s: open_site_data(fedavg.cfg, s, ("test",)).test for s in sites}
        probe = Probe("FedAvg (global model)", model, None)
        rows[probe.label] = {
            s: score(probe, s, fedavg_data[s], None, device, num_classes) for s in sites
        }
    out = args.out or args.run / "diagnostic"
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "run": str(args.run),
        "fedavg": str(args.fedavg) if args.fedavg else None,
        "round": run.last_round,
        "sites": sites,
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }
    (out / "diagnostic.json").write_text(json.dumps(record, indent=1))
    header = "| row | " + " | ".join(f"{s} Dice | {s} bg->instr %" for s in sites) + " |"
    lines = [
        f"Run {args.run} (round {record['round']}); Dice %, background read as instrument %",
        "",
        header,
        "|---" * (1 + 2 * len(sites)) + "|",
    ]
    for label, per_site in rows.items():
        cells = " | ".join(
            f"{per_site[s]['dice']:.2f} | {per_site[s]['background_as_instrument']:.1f}"
            for s in sites
        )
        lines.append(f"| {label} | {cells} |")
    names = ["background", "shaft", "wrist", "jaw"][:num_classes]
    for label in ("average, rule own", "average, rule fold", "FedAvg (global model)"):
        if label in rows:
            for s in sites:
                lines += [
                    "",
                    f"Confusion on {s}, {label} (% of each true class):",
                    "",
                    confusion_table(rows[label][s]["confusion"], names),
                ]
    text = "\n".join(lines) + "\n"
    (out / "diagnostic.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

"""Diagnose out-of-federation results: score every site's personalized model and the averaged model.

    .venv/bin/python -m studies.outfed_floor.outfed_sources RUN_DIR [RUN_DIR ...] [--sites E grasp]

For each run and each out-of-federation site, prints Dice (%) and per-class Dice of
(a) the out-of-federation model (sample-count-weighted average of all site models, as in
eval_outfed.py) and (b) each federated site's own personalized model gamma_g + rho_k, all prompted
with the unseen site's indicator. This separates "the shared representation does not transfer"
(every row low) from "averaging the personalized parts hurts" (some site model clearly higher).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedst.accel import resolve_device
from fedst.runs import Run
from fedst.scoring.evaluation import evaluate_model
from fedst.scoring.site_data import open_site_data


def _row(label: str, summary: dict) -> str:
    classes = " ".join(
        f"{name} {values['dice']:.1f}" if values.get("dice") is not None else f"{name} -"
        for name, values in summary["per_class"].items()
    )
    return f"  {label:<10} Dice {summary['dice']:6.2f}  IoU {summary['iou']:6.2f}  ({classes})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument(
        "--sites", nargs="*", default=None, help="default: the run's out-of-federation sites"
    )
    args = parser.parse_args(argv)
    for run_dir in args.runs:
        run = Run(run_dir)
        cfg = run.cfg
        device = resolve_device(cfg.train.device)
        indicators = run.method.indicators()
        models = {"average": run.outfed_model(device)}
        models.update({f"site {s}": run.site_model(s, device) for s in cfg.data.federation})
        for site in args.sites or cfg.data.out_of_federation:
            data = open_site_data(cfg, site, ("test",))
            print(f"{run_dir} [{cfg.method.name}] on {site}:")
            for label, model in models.items():
                result = evaluate_model(model, data.test, indicators.get(site), device)
                print(_row(label, result.summary))


if __name__ == "__main__":
    main()

"""What it costs when a site's message lands on a Ray actor that does not hold that site
(Flower hands each message to any idle actor; fedst.app.client_app.make_client_app).

    .venv/bin/python -m bench.site_rebuild                        # tiny preset, site A, 2 workers
    .venv/bin/python -m bench.site_rebuild experiment=paper data.procedural=paper_scale \\
        network.pretrained=false method.indicator=onehot          # a paper-size site

One site trains round 1 and saves its state, as the actor that last ran it would. Then, in this
process, as another actor:

* build: ``Site(...)`` (data index and validation through its cache, model, optimizer,
  state-folder claim): what ``ray.sites_per_actor`` saves for a site the actor holds;
* restore: its state of round 1 loaded from disk (every actor pays it when another actor trained
  the site since);
* first batch: the loader's workers started and the first batch loaded (likewise);

each ``--repeats`` times, median printed, with one local training step of the site for scale.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedst.accel import resolve_device
from fedst.cli import compose_experiment
from fedst.experiment import ExperimentConfig
from fedst.federation.site import Site
from fedst.methods import method_of
from fedst.training import prepare_data

log = logging.getLogger("bench.site_rebuild")


def time_rebuilds(
    site_name: str, cfg: ExperimentConfig, device: torch.device, state_dir: Path, repeats: int
) -> tuple[dict[str, list[float]], float]:
    """Seconds of each rebuild part per repeat, and one local training step for scale."""
    first = Site(site_name, cfg, state_dir, device)  # the actor that trained round 1
    full = {k: v.clone() for k, v in method_of(cfg).build_model().state_dict().items()}
    step = first.train_round(full, server_round=1, local_iters=1).seconds
    first.stream.close()
    del first
    times: dict[str, list[float]] = {"build": [], "restore": [], "first batch": []}
    for _ in range(repeats):
        started = time.perf_counter()
        site = Site(site_name, cfg, state_dir, device)
        built = time.perf_counter()
        site.restore(1)
        restored = time.perf_counter()
        site.stream.next_batch()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        loaded = time.perf_counter()
        times["build"].append(built - started)
        times["restore"].append(restored - built)
        times["first batch"].append(loaded - restored)
        site.stream.close()
        del site
    return times, step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.site_rebuild", description=__doc__)
    parser.add_argument("--site", default="A")
    parser.add_argument("--workers", type=int, default=2, help="train.num_workers of the site")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="train_fed.py overrides (default: tiny)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    overrides = args.overrides or ["experiment=tiny"]
    cfg, _ = compose_experiment([*overrides, f"train.num_workers={args.workers}"])
    prepare_data(cfg)
    device = resolve_device(cfg.train.device)
    with tempfile.TemporaryDirectory(prefix="fedst_rebuild_") as state_dir:
        times, step = time_rebuilds(args.site, cfg, device, Path(state_dir), args.repeats)
    print(f"site {args.site} on {device}, {args.workers} loader worker(s), {overrides}:")
    for name, values in times.items():
        print(f"  {name:12s} {statistics.median(values):7.3f} s  (median of {len(values)})")
    print(f"  one local training step (round 1, incl. loader start): {step:.3f} s")


if __name__ == "__main__":
    main()

"""What CFFM's supervision of every clip frame costs a site (``train.clip_frame_loss_weight``;
docs/design-notes.md, "The temporal module against CFFM", row 11): one local training step of a
site (``Site.train_phase`` of one iteration: the batch from the site's stream, the step, AdamW) at
weight 0 (the current frame's label only) and at ``--weight`` (every clip frame's label read and
augmented, the decoder on all T frames, their loss), the two sites built in one process and their
steps interleaved, so both see the same machine load.

    python -m bench.clip_frame_loss                            # tiny and demo presets, w = 0.5
    python -m bench.clip_frame_loss --presets demo --steps 20 --weight 0.5

Prints, per preset, each weight's median and minimum step in ms and their ratios (weight w over
weight 0), with the CPU model and the load average: on a shared machine the ratio of the minima
is the steadier figure. Loader workers: 0 (the labels are read in the step's process, so their
cost is counted).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedst.accel import device_name
from fedst.cli import compose_experiment
from fedst.federation.site import Site
from fedst.methods import LocalPhase
from fedst.training import prepare_data

WARMUP_STEPS = 2


def build_site(preset: str, weight: float, state_dir: Path, overrides: list[str]) -> Site:
    """Site A of ``experiment=<preset>`` at ``train.clip_frame_loss_weight=<weight>`` on the CPU,
    its loader in this process."""
    cfg, _ = compose_experiment(
        [
            f"experiment={preset}",
            f"train.clip_frame_loss_weight={weight}",
            "train.num_workers=0",
            "train.device=cpu",
            *overrides,
        ]
    )
    prepare_data(cfg)
    return Site(cfg.data.federation[0], cfg, state_dir, torch.device("cpu"))


def step_ms(site: Site) -> float:
    """Wall milliseconds of one local iteration of ``site`` (batch, step, AdamW)."""
    started = time.perf_counter()
    site.train_phase(LocalPhase(1), server_round=1)
    return (time.perf_counter() - started) * 1000.0


def compare(preset: str, weight: float, steps: int, overrides: list[str]) -> dict[float, list]:
    """weight -> its ``steps`` step times (ms), the two sites' steps interleaved after warm-up."""
    with tempfile.TemporaryDirectory(prefix="fedst_clip_frame_loss_") as state_root:
        sites = {
            w: build_site(preset, w, Path(state_root) / str(w), overrides) for w in (0, weight)
        }
        for site in sites.values():
            for _ in range(WARMUP_STEPS):
                step_ms(site)
        times: dict[float, list] = {w: [] for w in sites}
        for _ in range(steps):
            for w, site in sites.items():
                times[w].append(step_ms(site))
        for site in sites.values():
            site.close_loaders()
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.clip_frame_loss", description=__doc__)
    parser.add_argument("--presets", nargs="+", default=["tiny", "demo"])
    parser.add_argument("--weight", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per weight")
    parser.add_argument("overrides", nargs="*", help="train_fed.py overrides of every preset")
    args = parser.parse_args(argv)
    if args.weight <= 0:
        parser.error(f"--weight {args.weight}: compare a weight > 0 with 0")
    logging.basicConfig(level=logging.WARNING)
    print(f"{device_name(torch.device('cpu'))}, {torch.get_num_threads()} thread(s)")
    for preset in args.presets:
        times = compare(preset, args.weight, args.steps, args.overrides)
        off, on = times[0], times[args.weight]
        print(
            f"{preset}: one site step, weight 0: median {statistics.median(off):.0f} ms (min "
            f"{min(off):.0f}); weight {args.weight}: median {statistics.median(on):.0f} ms (min "
            f"{min(on):.0f}); ratio of medians {statistics.median(on) / statistics.median(off):.2f}"
            f", of minima {min(on) / min(off):.2f} ({args.steps} interleaved steps each)"
        )
    load = " ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"load average (1, 5, 15 min): {load}")


if __name__ == "__main__":
    main()

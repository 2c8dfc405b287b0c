"""Cost of one site training step with the temporal module in the encoder and in the decode head.

``network.temporal_placement`` = "encoder" (after encoder stage 1, before the decoder; the
default until issue 58) against "decode_head" (CFFM's and the default: every clip frame through
the decoder, the block on the fused maps at 1/8, a second classifier;
fedst/model/temporal_head.py), the current frame's loss only (the per-frame term's cost:
bench/clip_frame_loss.py). Each is FedST's network
of the chosen preset (``method.build_model()``), trained as a site trains it: the Eq. 9 loss,
AdamW over the site's parameter groups (fedst/methods/optimizer.py), a batch of the preset's
size and clip length at its image size (random clips, the indicator a random unit vector).
The two steps run round-robin, so both see the same machine load; the minimum over the runs is
the estimate, and the ratio decode_head / encoder is printed from the same run. Run from the
repository root:

    .venv/bin/python -m bench.temporal_placement                      # the tiny preset, 64x80
    .venv/bin/python -m bench.temporal_placement --experiment demo --repeats 10

The last line is ``site step decode_head/encoder: <ratio> (wall), <ratio> (CPU)``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch

from bench.model import interleaved_times
from fedst.accel import device_name
from fedst.cli import compose_experiment
from fedst.methods import method_of
from fedst.methods.optimizer import param_groups
from fedst.schema.network import TEMPORAL_PLACEMENTS


def site_step(experiment: str, placement: str) -> tuple[Callable[[], None], int]:
    """One site training step of ``experiment``'s FedST network with the temporal module at
    ``placement`` -> (the step, the network's parameter count)."""
    cfg, _ = compose_experiment(
        [f"experiment={experiment}", "method=fedst", f"network.temporal_placement={placement}"]
    )
    method = method_of(cfg)
    torch.manual_seed(0)
    model = method.build_model().train()
    if hasattr(model, "prepare_temporal"):
        model.prepare_temporal(tuple(cfg.clip.image_size))
    loss_fn = method.segmentation_loss()
    optimizer = torch.optim.AdamW(
        param_groups(model.named_parameters(), cfg.train),
        lr=cfg.train.lr,
        weight_decay=cfg.train.weight_decay,
    )
    height, width = cfg.clip.image_size
    generator = torch.Generator().manual_seed(0)
    batch = cfg.train.batch_size
    clips = torch.randn(batch, cfg.network.num_frames, 3, height, width, generator=generator)
    masks = torch.randint(0, cfg.network.num_classes, (batch, height, width), generator=generator)
    indicator = torch.nn.functional.normalize(
        torch.randn(cfg.network.indicator_dim, generator=generator), dim=0
    )

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(clips, indicator), masks).backward()
        optimizer.step()

    return step, sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--experiment", default="tiny", help="experiment preset (tiny, demo)")
    parser.add_argument("--repeats", type=int, default=20, help="timed round-robin runs")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps, sizes = {}, {}
    for placement in TEMPORAL_PLACEMENTS:
        steps[placement], sizes[placement] = site_step(args.experiment, placement)
    times = interleaved_times(steps, args.repeats)
    print(
        f"{device_name(torch.device('cpu'))}, {args.threads} thread(s), load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; preset {args.experiment}, "
        f"{args.repeats} runs after 1 warm-up, min (median) ms"
    )
    best = {}
    for placement, (wall, cpu) in times.items():
        best[placement] = (min(wall), min(cpu))
        median = sorted(wall)[len(wall) // 2]
        print(
            f"  {placement:12s} {sizes[placement]:>10,d} parameters  wall {min(wall):8.1f} "
            f"({median:.1f})  CPU {min(cpu):8.1f}"
        )
    (enc_wall, enc_cpu), (head_wall, head_cpu) = best["encoder"], best["decode_head"]
    print(
        f"site step decode_head/encoder: {head_wall / enc_wall:.2f} (wall), "
        f"{head_cpu / enc_cpu:.2f} (CPU)"
    )


if __name__ == "__main__":
    main()

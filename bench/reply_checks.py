"""Cost of the reply checks (issues 45 and 59) against a round, at the paper's size.

The network of ``experiment=paper`` (PVTv2-b0, 512x640; random init with the same shapes, nothing
downloaded) and FedST's shared parameters gamma. Timed, best of ``--repeats`` interleaved runs:

* server: the checks of one round's ``--sites`` training replies (fedst.federation.reply_checks:
  keys, shapes, dtypes, finite values, the magnitude bound, sample counts and data-size changes,
  the update norms and the norm rule, the server's weights; the reply schema of
  fedst/app/reply_schema.py on each reply's records; the check of the server's own aggregate),
  each reply gamma plus small noise, beside the update norms as the server computed them before
  the checks (for its train.jsonl; the checks now compute them in the same pass as the finite
  check);
* site: its own check of gamma_k after local training (Site.train_round) and the wire-value
  check of packing (transport.pack), beside a whole fp32 pack;
* one local training step at 512x640 (batch 2, 4-frame clips, AdamW); a site's round is
  ``train.local_iters`` (paper: 100) such steps, the least a round can take (the in-process engine
  runs every site's steps one after the other, and SERQ and evaluation come on top).

Run from the repository root (one thread by default, like the project's CI):

    .venv/bin/python -m bench.reply_checks
    .venv/bin/python -m bench.reply_checks --repeats 3 --sites 4 --gpu-step-ms 122

``--gpu-step-ms``: also compare with a round of that step time (docs/gpu_runs: 122-140 ms per
iteration on an H200 at the paper's size).

The last line is ``checks / site round: <server %> (server), <site %> (site)``: the checks
against one site's round, the least a round takes.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch
from flwr.app import ConfigRecord, MessageType, MetricRecord, RecordDict

from bench.model import interleaved_ms
from fedst.app.reply_schema import reply_schemas, screen
from fedst.cli import compose_experiment
from fedst.federation import transport
from fedst.federation.reply_checks import (
    ReplyChecker,
    Update,
    aggregate_problem,
    magnitude_bound,
)
from fedst.methods import method_of
from fedst.methods.privacy import update_l2_norm as update_norm
from fedst.model.state import state_subset


def site_check(shared: dict[str, torch.Tensor]) -> bool:
    """Site.train_round's check of gamma_k (one stack, one host sync)."""
    floats = [v.isfinite().all() for v in shared.values() if v.is_floating_point()]
    return bool(torch.stack(floats).all())


def wire_check(shared: dict[str, torch.Tensor]) -> bool:
    """transport.pack's check of each tensor after its cast to the wire dtype (fp32 here)."""
    return all(bool(v.float().isfinite().all()) for v in shared.values() if v.is_floating_point())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gpu-step-ms", type=float, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg, _ = compose_experiment(
        ["experiment=paper", "network.pretrained=false", "train.device=cpu", "data.root=unused"]
    )
    method = method_of(cfg)
    model = method.build_model()
    gamma = state_subset(model, method.partition(model).shared)
    values = sum(v.numel() for v in gamma.values())
    print(
        f"paper config: {cfg.clip.image_size[0]}x{cfg.clip.image_size[1]}, "
        f"{len(gamma)} shared tensors, {values:,} values ({4 * values / 1e6:.1f} MB fp32)"
    )
    replies = {
        f"site{k}": Update(
            {
                key: v + 1e-3 * torch.randn_like(v) if v.is_floating_point() else v.clone()
                for key, v in gamma.items()
            },
            num_examples=100,
            data_size=100,
        )
        for k in range(args.sites)
    }
    bound = magnitude_bound("fp32")
    checker = ReplyChecker(max_update_ratio=10.0, max_data_change=2.0, bound=bound)
    one = replies["site0"].state
    schema = reply_schemas()[MessageType.TRAIN]
    records = [  # what the schema reads of a train reply: its records (the tensors: their checks)
        SimpleNamespace(
            content=RecordDict(
                {
                    **transport.pack(u.state, "fp32").records(),
                    "metrics": MetricRecord(
                        {"num-examples": 100, "train-loss": 0.5, "seconds": 12.0}
                    ),
                    "site": ConfigRecord({"site": site, "round": 2, "data-size": 100}),
                }
            )
        )
        for site, u in replies.items()
    ]

    def server_checks() -> None:
        assert all(screen(r, schema).problem is None for r in records)
        refusals, _ = checker.check(replies, gamma)
        assert not refusals
        checker.weights(replies)
        assert aggregate_problem(gamma, bound) is None  # the aggregate: one more tensor set

    timed = interleaved_ms(
        {
            "server checks": server_checks,
            "update norms": lambda: [update_norm(u.state, gamma) for u in replies.values()],
            "site check": lambda: site_check(one),
            "wire check": lambda: wire_check(one),
            "pack": lambda: transport.pack(one, "fp32"),
        },
        args.repeats,
    )
    height, width = cfg.clip.image_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    clips = torch.randn(cfg.train.batch_size, cfg.clip.num_frames, 3, height, width)
    masks = torch.randint(0, cfg.network.num_classes, (cfg.train.batch_size, height, width))
    indicator = torch.nn.functional.normalize(torch.randn(cfg.indicator.dim), dim=0)
    loss_fn = method.segmentation_loss()

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(clips, indicator), masks).backward()
        optimizer.step()

    started = time.perf_counter()
    step_ms = interleaved_ms({"step": train_step}, max(1, args.repeats // 2))["step"][0]
    round_ms = cfg.train.local_iters * step_ms
    print(
        f"one local step at {height}x{width}: {step_ms:.0f} ms "
        f"(timed in {time.perf_counter() - started:.0f} s); a site's round = "
        f"{cfg.train.local_iters} steps = {round_ms / 1000:.0f} s"
    )
    server_ms = timed["server checks"][0]
    site_ms = timed["site check"][0] + timed["wire check"][0]
    print(
        f"server, {args.sites} replies: all checks and the update norms {server_ms:.1f} ms; "
        f"the norms alone as computed before issue 45 (privacy.update_l2_norm, logged in "
        f"train.jsonl) {timed['update norms'][0]:.1f} ms"
    )
    print(
        f"site: gamma_k check {timed['site check'][0]:.1f} ms, wire-value check "
        f"{timed['wire check'][0]:.1f} ms (of a {timed['pack'][0]:.1f} ms pack)"
    )
    print(
        f"checks / in-process round ({args.sites} sites' steps): "
        f"{100 * server_ms / (args.sites * round_ms):.4f} % (server)"
    )
    print(
        f"checks / site round: {100 * server_ms / round_ms:.4f} % (server), "
        f"{100 * site_ms / round_ms:.4f} % (site)"
    )
    if args.gpu_step_ms is not None:
        gpu_round_ms = cfg.train.local_iters * args.gpu_step_ms
        print(
            f"checks / GPU site round ({cfg.train.local_iters} x {args.gpu_step_ms:g} ms): "
            f"{100 * server_ms / gpu_round_ms:.4f} % (server)"
        )


if __name__ == "__main__":
    main()

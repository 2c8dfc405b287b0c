"""What FedLD's principal-direction aggregation costs at the server against the plain mean.

    python -m bench.fedld_aggregation [--sites 4] [--experiment demo]

Constructed updates (seeded Gaussian, 1e-3) of every shared tensor of the FedLD network (the
single-frame PVTv2-b0 + decoder; the parameter count does not depend on the input size), one
thread, float64 as the server computes them (fedst/methods/fedld.py).
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--experiment", default="demo")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from fedst.cli import compose_experiment
    from fedst.methods import method_of
    from fedst.methods.fedld import principal_direction_update

    cfg, _ = compose_experiment([f"experiment={args.experiment}", "method=fedld"])
    method = method_of(cfg)
    model = method.build_model()
    state = model.state_dict()
    shared = [state[k].double().flatten() for k in method.partition(model).shared]
    generator = torch.Generator().manual_seed(0)
    updates = [1e-3 * torch.randn(args.sites, v.numel(), generator=generator) for v in shared]
    updates = [u.double() for u in updates]
    weights = torch.full((args.sites,), 1 / args.sites, dtype=torch.float64)
    k = method.principal_directions(args.sites)

    started = time.perf_counter()
    for u in updates:
        weights @ u
    mean_seconds = time.perf_counter() - started
    started = time.perf_counter()
    for u in updates:
        if u.shape[1] == 1:
            weights @ u
        else:
            principal_direction_update(u, weights, k)
    fedld_seconds = time.perf_counter() - started
    total = sum(v.numel() for v in shared)
    print(
        f"{len(shared)} shared tensors, {total:,} parameters, {args.sites} sites, k = {k}: "
        f"plain mean {mean_seconds:.2f} s, FedLD {fedld_seconds:.2f} s per round"
    )


if __name__ == "__main__":
    main()

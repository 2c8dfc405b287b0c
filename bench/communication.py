"""Upload per site and round, by method reading and wire precision, and the ratio to FedAvg.

For each configuration (a method plus overrides, the paper-size network of experiment=paper, the
same PVTv2-b0 as the demo's; random weights: only shapes matter) this builds the method's partition and packs gamma exactly as the
ClientApp does (fedst/federation/transport.py), then prints parameter bytes in MB (10^6 bytes)
and MiB (2^20 bytes), the serialized size of its buffers and manifest, and the ratio to FedAvg in
fp32.

    .venv/bin/python -m bench.communication

The paper's Table IX reports FedST 12.69 and FedAvg 19.71 "MB" per round (ratio 0.644); its
FedRep figure 13.01 equals the PVTv2-b0 encoder in MiB, so its unit is most likely MiB.
"""

from __future__ import annotations

import argparse

from fedst.cli import compose_experiment
from fedst.federation import transport
from fedst.methods import method_of
from fedst.units import mebibytes, megabytes

READINGS = {
    "FedAvg": ["method=fedavg"],
    "FedST (queries + CS private; default)": ["method=fedst"],
    "FedST (Table IX reading: RSC private)": ["method=fedst", "method.personalization=rsc"],
    "FedST, encoder only shared": ["method=fedst", "method.shared_components=[encoder]"],
}


def upload(overrides: list[str], precision: str) -> tuple[int, int]:
    """(parameter bytes, serialized bytes of buffers and manifest) of one site's upload of gamma_k."""
    cfg, _ = compose_experiment(
        ["experiment=paper", "network.pretrained=false", *overrides, f"comm.precision={precision}"]
    )
    method = method_of(cfg)
    model = method.build_model()
    state = model.state_dict()
    packed = transport.pack({k: state[k] for k in method.partition(model).shared}, precision)
    return packed.param_bytes, packed.wire_bytes


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)  # --help only
    baseline, _ = upload(READINGS["FedAvg"], "fp32")
    print("| reading | precision | MB | MiB | message bytes | / FedAvg fp32 |")
    print("|---|---|---:|---:|---:|---:|")
    for name, overrides in READINGS.items():
        for precision in ("fp32", "fp16", "bf16"):
            params, message = upload(overrides, precision)
            print(
                f"| {name} | {precision} | {megabytes(params):.2f} | {mebibytes(params):.2f} | {message:,} | "
                f"{params / baseline:.3f} |"
            )


if __name__ == "__main__":
    main()

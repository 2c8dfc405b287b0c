"""The command line of DAD: fit the corrections of a finished run (see the package docstring)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from fedst.errors import ArgumentParser
from fedst.guard.correction import GuardConfig, GuardError
from fedst.guard.fitting import run_guard
from fedst.runs.device_option import add_device_option, device_run

log = logging.getLogger("fedst.guard")

DESCRIPTION = "GEN-Guard's correction step: Disagreement-Aware Distillation (DAD) at each site, after training."


def main(argv: Sequence[str] | None = None) -> list[Path]:
    parser = ArgumentParser(prog="python -m fedst.guard", description=DESCRIPTION)
    parser.add_argument("run_dir", type=Path, help="run directory written by train_fed.py")
    parser.add_argument(
        "--site",
        nargs="+",
        help="only these sites (default: every training site and the held-out site)",
    )
    parser.add_argument("--epochs", type=int, help=f"T_max (default {GuardConfig.epochs})")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a DAD setting (a GuardConfig field of fedst/guard/correction.py), e.g. temperature_disagree=3",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_device_option(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from omegaconf import OmegaConf

    from fedst.config import build

    try:
        if any("=" not in item for item in args.set):
            raise GuardError(f"--set takes KEY=VALUE, got {args.set}")
        values = OmegaConf.to_container(OmegaConf.from_dotlist(args.set))
        if args.epochs is not None:
            values["epochs"] = args.epochs
        settings = build(GuardConfig, values, "guard")
        run = device_run(args.run_dir, args.device)
        written = run_guard(run, settings, args.site, not args.no_progress)
    except FileNotFoundError as err:  # a path the user gave: one line through the boundary
        raise GuardError(str(err)) from err
    for path in written:
        print(f"wrote {path}")
    return written

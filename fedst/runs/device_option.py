"""``--device``: the device override of the commands that score a finished run's models
(fedst.guard; fedst.report, its msf and matrix), the argparse form of
train_fed.py's and eval_outfed.py's ``train.device=``. One rule for all of them: the value is
checked as the config checks ``train.device`` (auto | cpu | cuda | cuda:N) and resolved by
fedst.experiment.run_device with the run's ``train.require_gpu`` (``Run.device``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from fedst.config import ConfigError
from fedst.experiment import with_device
from fedst.schema.accel import check_device_name

if TYPE_CHECKING:
    from fedst.runs.run import Run

DEVICE_OPTION = "--device"


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """``--device D`` on ``parser`` (``args.device``: None when not given)."""
    parser.add_argument(
        DEVICE_OPTION,
        type=_device_name,
        default=None,
        help="auto | cpu | cuda | cuda:N: the device to score on (default: the run's "
        "train.device, resolved as train_fed.py resolves it; a run sized for a GPU, "
        "train.require_gpu, runs on the CPU when asked)",
    )


def _device_name(value: str) -> str:
    try:
        check_device_name(DEVICE_OPTION, value)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return value


def device_run(run_dir: str | Path, device: str | None) -> Run:
    """The run in ``run_dir`` scored on ``device`` (None: its own ``train.device``); a device
    error names ``--device`` in its fix."""
    from fedst.runs.files import load_config
    from fedst.runs.run import Run

    return Run(run_dir, with_device(load_config(Path(run_dir)), device), DEVICE_OPTION)

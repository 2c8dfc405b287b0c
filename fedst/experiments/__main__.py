"""The entry point of `-m fedst.experiments`: see fedst/experiments/__init__.py."""

from fedst.errors import run_entry_point
from fedst.experiments.cli import main

run_entry_point(main, "python -m fedst.experiments")

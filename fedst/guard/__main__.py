"""The entry point of `-m fedst.guard`: see fedst/guard/__init__.py."""

from fedst.errors import run_entry_point
from fedst.guard.cli import main

run_entry_point(main, "python -m fedst.guard")

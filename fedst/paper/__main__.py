"""The entry point of `-m fedst.paper`: see fedst/paper/__init__.py."""

from fedst.errors import run_entry_point
from fedst.paper.cli import main

run_entry_point(main, "python -m fedst.paper")

"""The entry point of `-m fedst.data.procedural`: see fedst/data/procedural/cli.py."""

from fedst.data.procedural.cli import main
from fedst.errors import run_entry_point

run_entry_point(main, "python -m fedst.data.procedural")

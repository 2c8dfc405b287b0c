"""The entry point of `-m fedst.infer`: see fedst/infer/__init__.py."""

from fedst.errors import run_entry_point
from fedst.infer import main

run_entry_point(main, "python -m fedst.infer")

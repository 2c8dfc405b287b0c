"""The entry point of `-m fedst.report`: see fedst/report/tables.py."""

from fedst.errors import run_entry_point
from fedst.report.tables import main

run_entry_point(main, "python -m fedst.report")

"""The entry point of `-m fedst.guard`: see fedst/guard/__init__.py."""

from fedst.guard.cli import main

main()

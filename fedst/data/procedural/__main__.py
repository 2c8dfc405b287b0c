"""The entry point of `-m fedst.data.procedural`: see fedst/data/procedural/cli.py."""

from fedst.data.procedural.cli import main

main()

"""The entry point of `-m fedst.experiments`: see fedst/experiments/__init__.py."""

import sys

from fedst.experiments.cli import main

sys.exit(main())

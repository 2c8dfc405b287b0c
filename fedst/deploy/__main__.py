"""The entry point of ``-m fedst.deploy``: see fedst/deploy/cli.py."""

from fedst.deploy.cli import main
from fedst.errors import run_entry_point

if __name__ == "__main__":
    run_entry_point(main, "python -m fedst.deploy")

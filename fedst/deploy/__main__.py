"""The entry point of ``-m fedst.deploy``: see fedst/deploy/cli.py."""

import sys

from fedst.config import ConfigError
from fedst.deploy.cli import main
from fedst.deploy.processes import DeploymentError

if __name__ == "__main__":
    try:
        sys.exit(main())
    except (DeploymentError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)

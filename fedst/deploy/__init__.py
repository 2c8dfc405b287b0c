"""Run FedST across hospitals with Flower's deployment engine (SuperLink + one SuperNode per site).

    python train_fed.py site=server deploy.certs=certs deploy.keys=keys   # the coordinating server
    python train_fed.py site=A deploy.server=<host>:9092 deploy.certs=certs deploy.keys=keys
    python -m fedst.deploy local --sites A B C D [experiment=tiny ...]    # everything on 127.0.0.1
    python -m fedst.deploy certs --out certs --hosts server.example.org 10.0.0.5
    python -m fedst.deploy key --out keys --site A

The server process starts ``flower-superlink`` (TLS, SuperNode authentication), registers the
public key of every federated site found in ``deploy.keys``, starts the run with ``flwr run``
(the ServerApp of fedst/app/server_app.py, run config from pyproject.toml) and stops the SuperLink
at the end. A site process starts ``flower-supernode`` with its own node config (site name, data
folder, state folder, device, workers; fedst.experiment.SiteNodeConfig) with ``--isolation
process``, and next to it one long-lived ClientApp process (fedst.app.site_executor) that runs
every message of the run, so imports and the site's model and data are built once. Messages
carry only the
site view of the experiment, shared parameters and scalar metrics (docs/deployment.md).

Nothing here is needed by the in-process engine; the apps are the same in both.

The package: ``processes`` (environment, start and stop, the processes a stopped one detached,
ports, signals; DeploymentError),
``credentials`` (TLS certificates, site keys), ``superlink`` (the server's SuperLink, key
registration, ``flwr run``), ``supernode`` (a hospital's SuperNode and ClientApp process),
``server_app`` (the deployed ServerApp that ``flwr run`` starts), ``local`` (everything on
127.0.0.1) and ``cli`` (the command line of ``-m fedst.deploy``).

Layer: the top of the training stack; imports fedst.training, fedst.app and below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedst.lazy import lazy_exports

if TYPE_CHECKING:
    from fedst.deploy.cli import main
    from fedst.deploy.credentials import make_certificates, make_site_key, site_key_path
    from fedst.deploy.local import local
    from fedst.deploy.processes import (
        APP_DIR,
        BIN,
        DeploymentError,
        detached_children,
        free_port,
        process_env,
        start,
        stop,
        stop_child,
        stop_detached,
        terminate_on_signal,
        wait_for_port,
    )
    from fedst.deploy.superlink import (
        CONNECTION,
        register_sites,
        run_config_overrides,
        running_superlink,
        serve,
        superlink_command,
        write_connection,
    )
    from fedst.deploy.supernode import (
        CONNECTED,
        EXIT_AUTH_FAILED,
        EXIT_GRACE,
        SIGNAL_ENDS,
        SUPERNODE_EXITING,
        check_site_data,
        executor_command,
        serve_site,
        supernode_command,
    )


__all__ = [
    "APP_DIR",
    "BIN",
    "CONNECTED",
    "CONNECTION",
    "EXIT_AUTH_FAILED",
    "EXIT_GRACE",
    "SIGNAL_ENDS",
    "SUPERNODE_EXITING",
    "DeploymentError",
    "check_site_data",
    "detached_children",
    "executor_command",
    "free_port",
    "local",
    "main",
    "make_certificates",
    "make_site_key",
    "process_env",
    "register_sites",
    "run_config_overrides",
    "running_superlink",
    "serve",
    "serve_site",
    "site_key_path",
    "start",
    "stop",
    "stop_child",
    "stop_detached",
    "superlink_command",
    "supernode_command",
    "terminate_on_signal",
    "wait_for_port",
    "write_connection",
]

EXPORTED_FROM = {
    "main": "fedst.deploy.cli",
    "make_certificates": "fedst.deploy.credentials",
    "make_site_key": "fedst.deploy.credentials",
    "site_key_path": "fedst.deploy.credentials",
    "local": "fedst.deploy.local",
    "APP_DIR": "fedst.deploy.processes",
    "BIN": "fedst.deploy.processes",
    "DeploymentError": "fedst.deploy.processes",
    "detached_children": "fedst.deploy.processes",
    "free_port": "fedst.deploy.processes",
    "process_env": "fedst.deploy.processes",
    "start": "fedst.deploy.processes",
    "stop": "fedst.deploy.processes",
    "stop_child": "fedst.deploy.processes",
    "stop_detached": "fedst.deploy.processes",
    "terminate_on_signal": "fedst.deploy.processes",
    "wait_for_port": "fedst.deploy.processes",
    "CONNECTION": "fedst.deploy.superlink",
    "register_sites": "fedst.deploy.superlink",
    "run_config_overrides": "fedst.deploy.superlink",
    "running_superlink": "fedst.deploy.superlink",
    "serve": "fedst.deploy.superlink",
    "superlink_command": "fedst.deploy.superlink",
    "write_connection": "fedst.deploy.superlink",
    "CONNECTED": "fedst.deploy.supernode",
    "EXIT_AUTH_FAILED": "fedst.deploy.supernode",
    "EXIT_GRACE": "fedst.deploy.supernode",
    "SIGNAL_ENDS": "fedst.deploy.supernode",
    "SUPERNODE_EXITING": "fedst.deploy.supernode",
    "check_site_data": "fedst.deploy.supernode",
    "executor_command": "fedst.deploy.supernode",
    "serve_site": "fedst.deploy.supernode",
    "supernode_command": "fedst.deploy.supernode",
}
"""Each name of :data:`__all__` -> the module that defines it, imported on first use: the
supernode module imports the training stack (fedst.app), which `python -m fedst.deploy --help`
and a wrong argument do not need."""


__getattr__ = lazy_exports(__name__, EXPORTED_FROM, globals())

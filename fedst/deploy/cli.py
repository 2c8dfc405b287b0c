"""Run FedST across hospitals with Flower's deployment engine (SuperLink + one SuperNode per site).

The command line of ``-m fedst.deploy`` (see the package docstring; the line above is its
``--help`` description): ``local``, a whole deployment on this machine; ``certs``, a throw-away
CA and server certificate; ``key``, a site's key pair."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from fedst.deploy.credentials import make_certificates, make_site_key
from fedst.deploy.local import local
from fedst.deploy.processes import terminate_on_signal
from fedst.errors import ArgumentParser


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m fedst.deploy", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    local_help = "server + one process per site on 127.0.0.1, TLS and node authentication"
    run_local = commands.add_parser(
        "local", help=local_help, description=f"A whole deployment on this machine: {local_help}."
    )
    run_local.add_argument(
        "--sites",
        nargs="+",
        default=["A", "B", "C", "D"],
        help="the federated sites (default: A B C D); overrides may follow them",
    )
    run_local.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where the run, logs and site states are kept (default: a new runs/deploy_local/<time>)",
    )
    run_local.add_argument("overrides", nargs="*", help="train_fed.py overrides (experiment=tiny)")
    certs_help = "a throw-away CA and server certificate"
    certs = commands.add_parser(
        "certs", help=certs_help, description=f"TLS for a trial: {certs_help}."
    )
    certs.add_argument("--out", type=Path, required=True, help="folder for ca.crt, server.pem/key")
    certs.add_argument(
        "--hosts", nargs="+", default=["127.0.0.1", "localhost"], help="the server's names"
    )
    key_help = "a site's EC key pair (OpenSSH format)"
    key = commands.add_parser("key", help=key_help, description=f"Node authentication: {key_help}.")
    key.add_argument("--out", type=Path, required=True, help="folder for the key pair")
    key.add_argument("--site", required=True, help="the site the key belongs to")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.command == "certs":
        print(
            f"written: {make_certificates(args.out, args.hosts)}/{{ca.crt,server.pem,server.key}}"
        )
        return 0
    if args.command == "key":
        path = make_site_key(args.out, args.site)
        print(f"written: {path} (keep it at the site) and {path}.pub (send it to the server)")
        return 0
    sites, overrides = split_overrides(args.sites)
    if not sites:
        parser.error(f"local --sites {' '.join(args.sites)}: name at least one site")
    with terminate_on_signal():
        return local(sites, [*overrides, *args.overrides], args.workdir)


def split_overrides(values: Sequence[str]) -> tuple[list[str], list[str]]:
    """(site names, train_fed.py overrides) of what ``--sites`` took: its ``nargs="+"`` also
    takes the overrides written after it (``--sites A B C D experiment=tiny``), and a Hydra
    override is never a site name (``key=value``, ``+key=value``, ``~key``)."""
    overrides = [v for v in values if "=" in v or v.startswith(("+", "~"))]
    return [v for v in values if v not in overrides], overrides

"""Where and how a federation runs, beside the experiment itself: train_fed.py's runtime options
as a whole (:class:`Runtime`: engine, resume, progress, regenerate, site), the shares of Flower's
Ray simulation engine (``ray.*``, :class:`RayConfig`), a deployment's addresses, certificates,
timeouts and transfer settings (``deploy.*``, :class:`DeployConfig`), and how the server treats
sites that do not answer (:class:`RoundPolicy`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedst.config import ConfigError, build, require_at_least

EVAL_TIMEOUT_FACTOR = 3.0
"""``deploy.eval_timeout`` when unset: this many times ``deploy.round_timeout`` (DeployConfig)."""


def default_eval_timeout(round_timeout: float | None, eval_timeout: float | None) -> float | None:
    """``eval_timeout``, or EVAL_TIMEOUT_FACTOR x ``round_timeout`` when it is None (None when
    both are: no timeout)."""
    if eval_timeout is not None:
        return eval_timeout
    return None if round_timeout is None else EVAL_TIMEOUT_FACTOR * round_timeout


@dataclass(frozen=True)
class RoundPolicy:
    """How the server treats sites that do not answer (deployment; the in-process engine keeps
    the defaults: every site must answer, no timeout)."""

    min_sites: int | None = None
    """Fewest sites whose replies a round aggregates (None: every federated site). A round with
    fewer stops the run with a message naming the missing sites and their errors."""
    round_timeout: float | None = None
    """Seconds the server waits for the replies of one training step (and the other non-evaluation
    steps: final stage, personal exchange and export) (None: forever)."""
    eval_timeout: float | None = None
    """Seconds the server waits for the replies of one evaluate step, test or validation scores
    (None: forever). Longer than ``round_timeout`` in a deployment (``deploy.eval_timeout``):
    see there."""
    join_timeout: float = 0.0
    """Seconds the server waits for SuperNodes to connect: before round 1 for every site, before
    later rounds for sites that dropped out (then it goes on with those connected)."""
    collect_personal: bool = False
    """Ask each site once, at the end, for rho_k (out-of-federation average; deployment only:
    in-process the run directory already holds the sites' states)."""
    audit: bool = False
    """Write wire.jsonl: record names, keys and shapes of every message (tests, audits)."""
    reply_poll: float = 0.2
    """Seconds between two requests for the replies of a step (``deploy.reply_poll``)."""

    def __post_init__(self) -> None:
        if self.min_sites is not None and self.min_sites < 1:
            raise ConfigError(f"deploy.min_sites={self.min_sites}: must be >= 1 (or null: all)")
        if self.round_timeout is not None and self.round_timeout <= 0:
            raise ConfigError(f"deploy.round_timeout={self.round_timeout}: must be > 0 or null")
        if self.eval_timeout is not None and self.eval_timeout <= 0:
            raise ConfigError(f"deploy.eval_timeout={self.eval_timeout}: must be > 0 or null")
        if self.reply_poll <= 0:
            raise ConfigError(f"deploy.reply_poll={self.reply_poll}: must be > 0 seconds")


@dataclass(frozen=True)
class RayConfig:
    """``ray.*`` of train_fed.py with ``engine=ray``: what Flower's simulation engine reserves for
    each site actor (fedst.training.ray_client_resources: Flower's backend config
    ``client_resources``) and how many sites an actor keeps built. Ray starts as many actors as
    these shares fit in the machine, and hides the GPUs from an actor that reserved none.

    Flower hands each message to whichever actor is idle; ``site_affinity`` makes it the actor
    that ran the site last when that one is idle. An actor that gets a site builds it unless it
    holds it already (``sites_per_actor``), and restores its private state from disk when
    another actor trained it since (docs/paper-scale.md, "Several GPUs: Ray and deployment")."""

    num_cpus_per_site: float | str = "auto"
    """CPU cores per site actor; "auto" = max(1, CPU cores // number of sites), so at most one
    actor per site runs at a time."""
    num_gpus_per_site: float | str = "auto"
    """GPU share per site actor (0.25: four actors share one GPU; Flower's
    ``client_resources["num_gpus"]``); "auto" = min(1, GPUs / number of sites) from
    torch.cuda.device_count() (0 without CUDA: Ray hides the GPUs and sites train on the CPU)."""
    sites_per_actor: int | str = "all"
    """Built sites (model, optimizer, data) an actor keeps, least recently used released first;
    "all": every site it has run. Only the site an actor runs keeps its loader workers. A site
    an actor does not hold is rebuilt (seconds: the model, data index and state from disk); 1
    bounds each actor's memory (GPU: one site's model and optimizer) at one rebuild per move."""
    site_affinity: bool = True
    """Send each site's message to the actor that ran that site last when it is idle (with as
    many actors as sites: always, from round 2 on), so the site keeps its actor, its built model
    and its loader workers; false: Flower's own choice, the last idle actor
    (fedst/app/ray_affinity.py replaces Flower 1.41's pool class to do it)."""
    address: str | None = None
    """A running Ray cluster to use (``ray start --head`` on one machine, ``ray start
    --address=<head>:<port>`` on the others; docs/paper-scale.md): its head's ``host:port``, or
    "auto" for the cluster this machine belongs to; null: a Ray instance of this run's own, on
    this machine. On a cluster, give the shares explicitly ("auto" counts this machine's cores
    and GPUs); the GPU share is then not checked against this machine's GPUs."""

    def __post_init__(self) -> None:
        for name in ("num_cpus_per_site", "num_gpus_per_site"):
            value = getattr(self, name)
            if isinstance(value, str):
                if value != "auto":
                    raise ConfigError(f'ray.{name}={value!r}: a number or "auto"')
            else:
                require_at_least(f"ray.{name}", value, 0, 'or "auto"')
        if self.num_cpus_per_site == 0:
            raise ConfigError("ray.num_cpus_per_site=0: each site actor needs a CPU share > 0")
        if isinstance(self.sites_per_actor, str):
            if self.sites_per_actor != "all":
                raise ConfigError(
                    f'ray.sites_per_actor={self.sites_per_actor!r}: a count >= 1 or "all"'
                )
        else:
            require_at_least("ray.sites_per_actor", self.sites_per_actor, 1, 'or "all"')

    @property
    def site_limit(self) -> int | None:
        """``sites_per_actor`` as fedst.app.client_app.keep_live_sites takes it (None: all)."""
        return None if self.sites_per_actor == "all" else int(self.sites_per_actor)


@dataclass(frozen=True)
class DeployConfig:
    """``deploy.*`` of train_fed.py: where the server listens, where certificates and keys are,
    a site's state folder, and the server's dropout policy (docs/deployment.md)."""

    server: str = "127.0.0.1:9092"
    """Site: the SuperLink address host:port it connects to."""
    host: str = "0.0.0.0"
    """Server: interface the SuperLink listens on (one HTTPS port for sites and the CLI)."""
    port: int = 9092
    """Server: the SuperLink port (open it to the hospitals)."""
    certs: str = "certs"
    """Folder with ca.crt (everyone) and server.pem + server.key (server only)."""
    keys: str = "keys"
    """Server: <site>_key.pub of every federated site. Site: its private key <site>_key."""
    insecure: bool = False
    """Development only: no TLS and no SuperNode authentication."""
    state_dir: str = "site_state"
    """Site: folder of its private state (a sub-folder per run)."""
    site_port: int = 9094
    """Site: local port of the SuperNode's ClientApp runtime (one per SuperNode on a host)."""
    share_personal: bool = True
    """Site: send rho_k once at the end for the out-of-federation average (logged)."""
    connect_timeout: float = 120.0
    """Site: give up connecting to the server after this many seconds."""
    min_sites: int | None = None
    """Server: fewest sites a round aggregates (None: all)."""
    round_timeout: float | None = 600.0
    """Server: seconds to wait for the replies of one training step (and of the final stage and
    the personal exchange / export); null: forever."""
    eval_timeout: float | None = None
    """Server: seconds to wait for the replies of one evaluate step (test scores, validation
    scores); null: EVAL_TIMEOUT_FACTOR (3) x round_timeout. An evaluate step can take longer than
    a training step: a site scores its whole test (or validation) split, every frame at native
    resolution with HD95 / ASSD (distance transforms on the CPU), plus the other sites' splits
    under method.returned_model / scored sites, while a training step is a fixed
    train.local_iters batches. A site still evaluating when the step times out would be left
    out of the round (or stop the run below deploy.min_sites) although it is healthy."""
    join_timeout: float = 300.0
    """Server: seconds to wait for the sites to connect (before round 1; before later rounds for
    sites that dropped out)."""
    audit: bool = False
    """Server: write wire.jsonl (record names, keys and shapes of every message)."""
    flwr_home: str | None = None
    """FLWR_HOME of the Flower processes (default: <run dir>/flwr on the server,
    <state_dir>/flwr at a site)."""
    # -- message latency (docs/deployment.md, "What sets the time of a message") --------------
    reply_poll: float = RoundPolicy.reply_poll
    """Server: seconds between two requests of the ServerApp for the sites' replies. Flower's
    Grid.send_and_receive pauses 3 s, so a step ended up to 3 s after its last reply; a request
    to the SuperLink on the same host costs about a millisecond."""
    executor_poll: float = 0.1
    """Site: seconds between two requests of the site's executor (fedst.app.site_executor) for a
    task when it has none: a message waits at most this long once its SuperNode has it; a
    request to the SuperNode on the same host costs about a millisecond."""
    transfers_in_flight: int = 2
    """All: object requests in flight while a message's objects are pushed or pulled (Flower's
    FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES / _PULLS, default 2; Flower caps it at the host's
    cores). With gamma in a few buffers a message is a few 5 MiB chunks; raise it on a
    high-latency link."""
    chunk_mib: float = 5.0
    """All: largest piece of an array on the wire, in MiB (Flower's
    FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE, default 5 MiB): each piece is one request; keep it below
    the proxies' request-size limit between a hospital and the server."""

    def __post_init__(self) -> None:
        for name in ("reply_poll", "executor_poll", "chunk_mib"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"deploy.{name}={getattr(self, name)}: must be > 0")
        if self.transfers_in_flight < 1:
            raise ConfigError(
                f"deploy.transfers_in_flight={self.transfers_in_flight}: must be >= 1"
            )
        for name in ("round_timeout", "eval_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"deploy.{name}={value}: must be > 0 or null")
        if self.join_timeout < 0:
            raise ConfigError(f"deploy.join_timeout={self.join_timeout}: must be >= 0")

    def flower_env(self) -> dict[str, str]:
        """The environment variables through which Flower's processes read the transfer
        settings (flwr/supercore/constant.py, flwr/common/constant.py)."""
        return {
            "FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES": str(self.transfers_in_flight),
            "FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS": str(self.transfers_in_flight),
            "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE": str(int(self.chunk_mib * 2**20)),
        }

    def to_run_config(self) -> dict[str, Any]:
        """The server's policy keys as the deployed ServerApp's run config (``flwr run
        --run-config``; pyproject.toml's ``[tool.flwr.app.config]`` holds those of the defaults):
        :data:`POLICY_RUN_CONFIG` names, and 0 for None (TOML has no null)."""
        values = {}
        for key, name in POLICY_RUN_CONFIG.items():
            value = getattr(self, name)
            values[key] = NULL_AS_ZERO[name] if value is None else value
        return values

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> DeployConfig:
        """The inverse of :meth:`to_run_config` (other keys ignored): a key the run config lacks
        keeps this class's default, 0 reads as None for the keys that may be null."""
        defaults = cls()
        values: dict[str, Any] = {}
        for key, name in POLICY_RUN_CONFIG.items():
            if key not in run_config:
                continue
            value = run_config[key]
            if name in NULL_AS_ZERO:
                value = type(NULL_AS_ZERO[name])(value) or None
            elif isinstance(getattr(defaults, name), float):
                value = float(value)
            values[name] = value
        return build(cls, values, "deploy")

    def policy(self) -> RoundPolicy:
        return RoundPolicy(
            min_sites=self.min_sites,
            round_timeout=self.round_timeout,
            eval_timeout=default_eval_timeout(self.round_timeout, self.eval_timeout),
            join_timeout=self.join_timeout,
            collect_personal=True,
            audit=self.audit,
            reply_poll=self.reply_poll,
        )


POLICY_RUN_CONFIG = {
    "min-sites": "min_sites",
    "round-timeout": "round_timeout",
    "eval-timeout": "eval_timeout",
    "join-timeout": "join_timeout",
    "audit": "audit",
    "reply-poll": "reply_poll",
}
"""Run-config key of the deployed ServerApp (pyproject.toml ``[tool.flwr.app.config]``) ->
the :class:`DeployConfig` field it carries: the one codec of the server's round policy
(:meth:`DeployConfig.to_run_config`, :meth:`DeployConfig.from_run_config`)."""
NULL_AS_ZERO = {"min_sites": 0, "round_timeout": 0.0, "eval_timeout": 0.0}
"""Policy fields whose None travels as this zero in the run config (TOML has no null)."""

ENGINES = ("inprocess", "ray")
"""``engine``: Flower's Grid in this process | Flower's Ray simulation (fedst/training.py)."""


@dataclass(frozen=True)
class Runtime:
    """train_fed.py's top-level keys that steer the entry point, not the experiment (the
    experiment's own keys: :class:`fedst.experiment.ExperimentConfig`): each default is declared
    here once (fedst/cli.py puts them in Hydra's defaults; configs/config.yaml documents them)."""

    engine: str = "inprocess"
    """:data:`ENGINES`: inprocess (Flower Grid in this process) | ray (Flower simulation, needs
    flwr[simulation]; per-site CPU / GPU shares: ``ray.*``)."""
    resume: str | None = None
    """A run directory to continue from its last completed round (its own config is reused;
    fedst.cli.resume_experiment says which keys may change)."""
    progress: bool = True
    """Progress bars over rounds, local iterations and evaluation (only on a terminal)."""
    regenerate: bool = False
    """Rewrite the procedural benchmark in data.root even if it holds another one (deletes its
    videos/, splits/)."""
    site: str | None = None
    """Deployment (docs/deployment.md): server | a federated site's name (A); None: a simulation."""
    deploy: DeployConfig = field(default_factory=DeployConfig)
    """``deploy.*``: the deployment's addresses, certificates, timeouts and transfer settings."""
    ray: RayConfig = field(default_factory=RayConfig)
    """``ray.*``: the site actors' shares under ``engine=ray``."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine={self.engine!r}: choose one of {', '.join(ENGINES)}")

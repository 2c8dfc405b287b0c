"""Upper bound (paper Sec. IV-B, Tables II, III, VIII): one model trained on the pooled training
data of every federated site, a centralised run without federation.

It runs on the one federation code path with a single training party, :data:`POOLED`, whose
training split is the concatenation of the federated sites' training splits in federation order
(fedst.scoring.site_data.PooledClips; with ``data.mix_synthetic`` the server's synthetic set
follows once), shuffled by the party's seeded batch stream. It trains
``train.rounds x train.local_iters = train.total_iters`` iterations, the same total as each site
of a federation, with the configured batch size; nothing travels after the initial (synthetically
pre-trained) model (``communicate: false``, every tensor private, so each upload is empty).
Its model is scored on every federated site's test split (one metrics row per site) and, being
the only site model, it is also the out-of-federation model.
"""

from __future__ import annotations

from fedst.config import ConfigError
from fedst.experiment import ExperimentConfig
from fedst.methods.base import Method

POOLED = "pooled"
"""The name of the upper bound's one training party (its state folder: <run>/sites/pooled)."""


class UpperBound(Method):
    """One party trained on the pool of every federated site's training data."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        super().__init__(cfg)
        if POOLED in cfg.data.sites:
            raise ConfigError(
                f"method.algorithm=upperbound names its training party {POOLED!r}, but data.sites "
                f"has a site of that name: rename the site"
            )
        if self.config.communicate or self.config.personalization != "all":
            raise ConfigError(
                f"method.algorithm=upperbound trains one centralised model: set "
                f"method.communicate=false and method.personalization=all (got "
                f"communicate={self.config.communicate}, "
                f"personalization={self.config.personalization!r}); configs/method/upperbound.yaml"
            )
        if cfg.uses_indicator():
            raise ConfigError(
                "method.algorithm=upperbound: the pooled party is no site and has no site "
                "indicator; set method.prompt=false and method.channel_selection=false"
            )

    def training_sites(self) -> tuple[str, ...]:
        return (POOLED,)

    def train_sources(self, party: str) -> tuple[str, ...]:
        """The pool: every federated site's training split, in federation order."""
        return tuple(self.cfg.data.federation)

    def scored_sites(self, party: str) -> tuple[str, ...]:
        """Every federated site's test split."""
        return tuple(self.cfg.data.federation)

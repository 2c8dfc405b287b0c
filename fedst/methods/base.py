"""What a federated method is: a small set of choices over the one federation code path.

Every method answers the same questions, and the site and server code ask them through one
:class:`Method` object built from the experiment (``method_of(cfg)``, fedst/methods/__init__.py):

* who trains on what: the training parties (:meth:`Method.training_sites`, one node each), the
  sites whose training data each reads (:meth:`Method.train_sources`) and whose test splits score
  its model (:meth:`Method.scored_sites`); by default every federated site on its own data;
* what every party builds: the network (:meth:`Method.build_model`), which of its tensors stay at
  the site (:meth:`Method.partition`), the site indicators xi_k (:meth:`Method.indicators`);
* the site's round (Algorithm 1, lines 5-7): how the received shared parameters are adopted
  (:meth:`Method.adopt`), in which phases the local iterations run and which tensors each phase
  trains (:meth:`Method.local_phases`), the local objective (:meth:`Method.local_loss`, plus
  :meth:`Method.clip_frame_term` under ``train.clip_frame_loss_weight``) and the
  scalars the reply carries besides gamma_k (:meth:`Method.reply_metrics`);
* the server's round (line 8): how the replies are combined (:meth:`Method.aggregate`), the
  server's own step after it (:meth:`Method.server_step`: SERQ for FedST, default none) and
  whether anything travels at all (``communicates``);
* which model a site returns and is scored with (:meth:`Method.load_returned_model`,
  ``method.returned_model``): its own gamma_k^T U rho_k^T (FedST, Algorithm 1 lines 14-17) or
  gamma_g as the site adopts it U rho_k (FedAvg, FedRep, FedAS, ...);
* after the last round: an optional final stage every site runs once (:meth:`Method.final_stage`,
  run by :meth:`Method.run_final_stage`; e.g. FedDP's inter-site tuning), default none.

:class:`Method` itself is *partial averaging*, the family of FedST: shared tensors are averaged by
Flower's FedAvg (uniform or sample-count weights) or FedMedian, personal tensors stay. FedST, every
ablation row of Tables IV-VII, FedAvg (nothing personal) and Local (nothing sent) are settings of
it. A baseline that computes something else subclasses it and overrides only its own steps
(fedst/methods/<name>.py); method-specific settings live in ``method.options`` and are typed by
the subclass's ``Options`` dataclass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from flwr.app import ArrayRecord, Message
from flwr.serverapp.strategy import Strategy
from torch import nn

from fedst.config import ConfigError, build
from fedst.data.clips import ClipDataset
from fedst.experiment import ExperimentConfig
from fedst.methods import privacy
from fedst.methods.aggregation import (
    SAMPLES_WEIGHT_KEY,
    UNIFORM_WEIGHT_KEY,
    WEIGHT_KEYS,
    make_strategy,
)
from fedst.methods.reply_fields import ReplyField
from fedst.methods.server_step import ServerContext, ServerStep
from fedst.model.losses import SegmentationLoss, clip_frame_loss
from fedst.model.network import FedSTNet, NetworkConfig, build_network
from fedst.model.partition import (
    PRESETS,
    Partition,
    PartitionRules,
    component_rules,
    split_state,
)
from fedst.model.state import load_subset
from fedst.schema.method_options import NoOptions
from fedst.seeding import seed_everything

BatchLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""A phase's own loss of (clips [B, T, 3, H, W], logits [B, C, H, W], masks [B, H, W])."""


class TrainingData(Protocol):
    """The training clips of the party a site trains for (:class:`fedst.scoring.site_data`)."""

    train: ClipDataset | None


class TrainingSite(Protocol):
    """What a method reads and calls of the site it trains at: :class:`fedst.federation.site.Site`
    (a protocol, so that the methods sit below the site runtime that runs them)."""

    name: str
    index: int
    """The site's position among the method's training parties (seeds its streams)."""
    cfg: ExperimentConfig
    device: torch.device
    model: FedSTNet
    loss_fn: SegmentationLoss
    indicator: torch.Tensor | None
    partition: Partition
    completed_round: int
    data: TrainingData

    def train_phase(
        self,
        phase: LocalPhase,
        server_round: int,
        optimizer: torch.optim.Optimizer | None = None,
        loss_of: BatchLoss | None = None,
    ) -> list[float]: ...


@dataclass(frozen=True)
class LocalPhase:
    """``iterations`` local steps during which only the tensors ``trainable`` accepts get gradients
    (``None``: every parameter trains)."""

    iterations: int
    trainable: Callable[[str], bool] | None = None
    name: str = "local"


PERSONAL_KEY_SEPARATOR = "/"
"""Keys of the other sites' rho_j in a final-stage message: "<site>/<state-dict key>"."""


@dataclass(frozen=True)
class FinalStage:
    """A stage every site runs once after the last federated round (round T + 1 in the logs).

    The server sends each site gamma_g (message ``train.final_stage``); with
    ``exchange_personal`` it first asks every site for rho_k (``query.personal_exchange``, only
    sites whose node config allows sharing answer with it) and sends each such site the rho_j of
    the other sites that agreed. The site then runs :meth:`Method.run_final_stage`, after which
    its whole model is its own (saved, evaluated and exported as such).
    """

    name: str
    """Label in the logs (train.jsonl ``stage``, comm.jsonl ``kind``)."""
    exchange_personal: bool = False
    """Every site needs the other sites' personalized parameters (an explicit, logged exchange)."""


class Method:
    """Partial averaging (FedST and its settings): see the module docstring."""

    Options: ClassVar[type] = NoOptions
    """Dataclass of ``method.options`` (built strictly: unknown keys are errors)."""

    reply_scalars: ClassVar[tuple[ReplyField, ...]] = ()
    """Scalars of the method's own in every train reply (:meth:`reply_metrics`), declared with
    their kind and range: the server checks them (fedst/app/reply_schema.py) before it reads one,
    e.g. FedAS's Fisher trace, the only site-reported value a weight is computed from. Uniform
    weights and n_k need no declaration: the server knows or validates them itself."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        self.config = cfg.method
        self.options = build(self.Options, cfg.method.options, "method.options")
        weight_key = WEIGHT_KEYS[self.config.aggregation_weights]
        declared = tuple(scalar.key for scalar in self.reply_scalars)
        if weight_key not in (UNIFORM_WEIGHT_KEY, SAMPLES_WEIGHT_KEY, *declared):
            raise ConfigError(
                f"method.aggregation_weights={self.config.aggregation_weights!r} weights each "
                f"reply by its {weight_key!r}, which the replies of method.algorithm="
                f"{self.config.algorithm!r} do not carry (they declare {declared or 'none'}); "
                f"choose uniform or samples"
            )
        privacy.check_privacy(cfg)
        if cfg.privacy.dp != "none" and type(self).aggregate is not Method.aggregate:
            raise ConfigError(
                f"privacy.dp={cfg.privacy.dp} wraps Flower's averaging strategy; method "
                f"{self.name} ({cfg.method.algorithm}) aggregates by its own rule"
            )
        self._strategy: Strategy | None = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def communicates(self) -> bool:
        """False: every site trains alone (Local); no tensor travels after the initial model."""
        return self.config.communicate

    @property
    def uses_serq(self) -> bool:
        """The server runs SERQ (Sec. III-C) after aggregation."""
        return self.config.serq

    def server_step(self, context: ServerContext) -> ServerStep | None:
        """The server's own step after aggregation: SERQ (Sec. III-C) when ``method.serq``,
        otherwise none (the aggregate is v_g's new gamma_g as it is)."""
        if not self.uses_serq:
            return None
        from fedst.methods.serq import SerqStep

        configured = (
            self.cfg.serq.feature_stage
        )  # F_ts's stage: the first the temporal module reads
        return SerqStep(
            self.cfg,
            context,
            indicator=self.indicators().get(self.cfg.data.server),
            loss_fn=self.segmentation_loss(),
            feature_stage=self.network_config().temporal_stages[0]
            if configured is None
            else configured,
            method_name=self.name,
        )

    # -- what every party builds ---------------------------------------------------------------
    def network_config(self) -> NetworkConfig:
        """The architecture the method trains (here: the experiment's, ``cfg.network_config()``)."""
        return self.cfg.network_config()

    def build_model(self) -> FedSTNet:
        """The method's network, initialised identically for every party (seeded by ``cfg.seed``)."""
        seed_everything(self.cfg.seed, 0xC0FFEE)
        return build_network(self.network_config())

    def partition(self, model: nn.Module) -> Partition:
        """Which state-dict keys stay at the site (rho), travel (gamma) or are fixed buffers."""
        preset = PRESETS[self.config.personalization]
        local_components = (
            component_rules(model, self.config.shared_components)
            if self.config.shared_components is not None
            else ()
        )
        rules = PartitionRules(
            (*preset.personal, *self.config.personal_patterns, *local_components)
        )
        return split_state(
            model,
            rules,
            personalize_channel_selection=self.config.personalize_channel_selection,
        )

    # -- who trains on what, and whose test splits score which model ---------------------------
    def training_sites(self) -> tuple[str, ...]:
        """The parties that train, one ClientApp node and one state folder each (here every
        federated site; the upper bound: one pooled party)."""
        return tuple(self.cfg.data.federation)

    def train_sources(self, party: str) -> tuple[str, ...]:
        """The federated sites whose training splits ``party`` trains on (here its own)."""
        return (party,)

    def scored_sites(self, party: str) -> tuple[str, ...]:
        """The federated sites whose test splits score ``party``'s model (here its own)."""
        return (party,)

    def synthetic_train_source(self) -> str | None:
        """The server's synthetic set when ``data.mix_synthetic`` mixes it into every training
        party's training split (Fig. 5's green line, Fig. 7), once per party; else None."""
        return self.cfg.data.server if self.cfg.data.mix_synthetic else None

    def data_sites(self, party: str) -> tuple[str, ...]:
        """Every site whose data ``party`` reads: its training sources, the mixed-in synthetic
        set (if any), then its scored sites. A deployed site's node config locates each of them
        on its own disk (fedst.app.nodes.site_node_config); nothing of it travels."""
        synthetic = tuple(filter(None, [self.synthetic_train_source()]))
        return tuple(
            dict.fromkeys((*self.train_sources(party), *synthetic, *self.scored_sites(party)))
        )

    def party_of(self, site: str) -> str:
        """The party whose model is scored on federated site ``site``'s test split."""
        for party in self.training_sites():
            if site in self.scored_sites(party):
                return party
        raise ConfigError(
            f"site {site!r}: no training party of method {self.name} is scored on it (parties: "
            f"{list(self.training_sites())}; federation: {list(self.cfg.data.federation)})"
        )

    def site_order(self) -> list[str]:
        """Fixed site order for one-hot / Gaussian indicators: federation, out-of-fed, the CBE
        held-out site (selection.held_out_site), server."""
        data, held_out = self.cfg.data, self.cfg.selection.held_out_site
        return [
            *data.federation,
            *data.out_of_federation,
            *([held_out] if held_out else []),
            *([data.server] if data.server else []),
        ]

    def indicators(self) -> dict[str, torch.Tensor]:
        """Frozen indicator xi_k of every site of the experiment (empty when the network uses none)."""
        if not self.cfg.uses_indicator():
            return {}
        from fedst.model.indicators import site_indicators

        names = self.site_order()
        sites = [(name, self.cfg.data.sites[name].surgery_type) for name in names]
        indicator = self.cfg.indicator
        return site_indicators(
            self.config.indicator,
            sites,
            dim=indicator.dim,
            site_order=names,
            clip_model=indicator.clip_model,
            clip_pretrained=indicator.clip_pretrained,
            cache_dir=indicator.cache_dir,
            seed=self.cfg.seed,
        )

    def segmentation_loss(self) -> SegmentationLoss:
        """L_seg = CE + lambda_1 Dice (Eq. 9): the supervised loss of every method. Its batches
        come from BatchStreams given ``network.num_classes`` (the site's, SERQ's, pre-training's),
        which check every batch's labels in their loader workers, so the loss does not check them
        again (a host read per step, fedst/model/losses.py)."""
        return SegmentationLoss(
            lambda_dice=self.cfg.train.lambda_dice,
            num_classes=self.cfg.network.num_classes,
            check_labels=False,
        )

    # -- the site's round (Algorithm 1, lines 5-7) ----------------------------------------------
    def adopt(
        self, site: TrainingSite, received: dict[str, torch.Tensor], server_round: int
    ) -> None:
        """Take the received parameters into the site's model (here: copy them in)."""
        load_subset(site.model, received)

    # -- the model a site returns (Algorithm 1, lines 14-17) -------------------------------------
    @property
    def returns_own_model(self) -> bool:
        """True (``method.returned_model=own``): a site returns, is scored with and enters the
        out-of-federation average as v_k = gamma_k U rho_k, its own shared parameters after its
        last local round. False (``global``): as gamma_g adopted by the site (:meth:`adopt`) U
        rho_k."""
        return self.config.returned_model == "own"

    def load_returned_model(
        self, site: TrainingSite, received: dict[str, torch.Tensor], server_round: int
    ) -> None:
        """Make ``site.model`` (v_k after its local round ``server_round``) the model the site
        returns at that round: own: keep it; global: adopt ``received`` (gamma_g after the round)
        as the site's next round will (FedAS: with its alignment)."""
        if not self.returns_own_model:
            self.adopt(site, received, server_round + 1)

    def local_phases(self, local_iters: int) -> list[LocalPhase]:
        """The round's local iterations: here one phase in which everything trains."""
        return [LocalPhase(local_iters)]

    def local_loss(
        self, site: TrainingSite, logits: torch.Tensor, masks: torch.Tensor
    ) -> torch.Tensor:
        """The local objective on one batch: logits [B, C, H, W] (float), masks [B, H, W]."""
        return site.loss_fn(logits, masks)

    @property
    def clip_frame_loss_weight(self) -> float:
        """The weight of every clip frame's own prediction in the local objective
        (``train.clip_frame_loss_weight``, CFFM's 0.5) where the network runs the temporal module
        on clips (``cfg.uses_clip_frame_labels()``); 0 otherwise: a single-frame network predicts
        the current frame only, so the option leaves it (the baselines of a preset that sets it,
        e.g. Table IV row 1, train as before) and its clips carry no earlier labels."""
        return self.cfg.train.clip_frame_loss_weight if self.cfg.uses_clip_frame_labels() else 0.0

    def clip_frame_term(
        self, site: TrainingSite, frame_logits: torch.Tensor, frame_masks: torch.Tensor
    ) -> torch.Tensor:
        """What the local objective adds for every clip frame's own prediction (CFFM):
        ``clip_frame_loss_weight x L_seg`` (fedst/model/losses.py, ``clip_frame_loss``) of
        frame_logits [B, T, K, H, W] (float) against frame_masks [B, T, H, W]. The method's own
        L_seg, as CFFM puts its one loss on both terms (docs/design-notes.md, CFFM row 11)."""
        return self.clip_frame_loss_weight * clip_frame_loss(
            site.loss_fn, frame_logits, frame_masks
        )

    def reply_metrics(self, site: TrainingSite) -> dict[str, float]:
        """Scalars the train reply carries besides n_k, the loss and the time (e.g. FedAS's
        Fisher trace, the server's aggregation weight)."""
        return {}

    def site_state(self, site: TrainingSite) -> dict[str, torch.Tensor]:
        """Tensors the site keeps on its disk after a round besides rho_k (here: none), e.g. FedAS's
        local base, which the next round's alignment starts from; saved with rho_k and given
        back to :meth:`load_site_state` when the site restores that round."""
        return {}

    def load_site_state(self, site: TrainingSite, state: dict[str, torch.Tensor]) -> None:
        """Take back what :meth:`site_state` saved (here: nothing)."""

    # -- the server's round (line 8) ------------------------------------------------------------
    @property
    def strategy(self) -> Strategy:
        """The Flower strategy of the mean, wrapped for DP when ``privacy.dp`` asks (built once:
        adaptive clipping keeps its bound from round to round)."""
        if self._strategy is None:
            inner = make_strategy(
                self.config.aggregation,
                self.config.aggregation_weights,
                self.cfg.fed.trim_fraction,
            )
            sites = len(self.cfg.data.federation)
            self._strategy = privacy.with_privacy(inner, self.cfg.privacy, sites)
        return self._strategy

    def weight_key(self) -> str:
        """The MetricRecord key the strategy weighs by; the server writes the weight it computed
        there (fedst/app/server_app.py), never a value a site sent."""
        return WEIGHT_KEYS[self.config.aggregation_weights]

    def weight_source(self) -> str | None:
        """What the server computes each reply's weight from: None (uniform: 1/K), the validated
        sample count n_k (``samples``) or the key of a scalar in :attr:`reply_scalars`."""
        mode = self.config.aggregation_weights
        return None if mode == "uniform" else WEIGHT_KEYS[mode]

    def instruction_config(self, server_round: int) -> dict[str, float]:
        """Values a train instruction carries besides the experiment (client-side DP: the bound)."""
        return privacy.instruction_config(self.strategy)

    def aggregate(
        self,
        server_round: int,
        replies: list[Message],
        current: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """gamma_g^{t+1} from the sites' replies (each an ArrayRecord "arrays" of gamma_k and a
        MetricRecord "metrics"); ``current`` is gamma_g^t, what the sites received.

        Partial averaging: Flower's FedAvg with uniform (1/K, Algorithm 1 line 8) or sample-count
        weights, or FedMedian (fedst/methods/aggregation.py)."""
        privacy.prepare_aggregation(self.strategy, ArrayRecord(current))
        aggregated, _ = self.strategy.aggregate_train(server_round, replies)
        return aggregated.to_torch_state_dict() if aggregated else {}

    def state_dict(self) -> dict[str, Any]:
        """The method's own server state for the checkpoint (adaptive DP: the clipping bound)."""
        bound = getattr(self.strategy, "clipping_norm", None)
        return {} if bound is None else {"clipping_norm": float(bound)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "clipping_norm" in state:
            self.strategy.clipping_norm = state["clipping_norm"]

    # -- after the last round ---------------------------------------------------------------------
    def final_stage(self) -> FinalStage | None:
        """The stage every site runs once after the last round; None (here): the run ends there."""
        return None

    def run_final_stage(
        self,
        site: TrainingSite,
        shared: dict[str, torch.Tensor],
        others: dict[str, dict[str, torch.Tensor]],
        server_round: int,
    ) -> dict[str, float]:
        """At a site, the final stage on its model v_k = gamma_g U rho_k (``shared``: gamma_g,
        already loaded into ``site.model``; ``others``: site -> rho_j of the other sites that
        shared theirs). Returns the reply's scalars ("train-loss" and "iterations" when it trains);
        the site saves its model afterwards."""
        raise NotImplementedError(f"method {self.name} has no final stage")

    def describe(self) -> dict[str, Any]:
        """What the run log records about the method's choices."""
        return {"algorithm": self.config.algorithm, "name": self.name}

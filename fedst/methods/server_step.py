"""The hook a method's server step plugs into (Algorithm 1, lines 9-11): what it is given, what it
answers. FedST's SERQ is the one implementation (fedst/methods/serq.py, ``SerqStep``); the server
(fedst/federation/server.py) calls it without knowing which method it belongs to."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fedst.accel import Precision
from fedst.model.network import FedSTNet

if TYPE_CHECKING:
    from fedst.methods.pretraining import PretrainResult


@dataclass(frozen=True)
class ServerContext:
    """What a method's server step works with: the server's network v_g and where it runs."""

    global_model: FedSTNet
    device: torch.device
    precision: Precision
    """The server's mixed precision (fedst.accel.resolve_precision of ``train.amp_dtype``)."""
    run_dir: Path
    """The run directory: a step keeps files of its own there (SERQ's feature bank)."""
    progress: bool = False


@dataclass(frozen=True)
class StepFiles:
    """What a server step wrote beside the server checkpoint of a round."""

    bytes: int = 0
    files: int = 0


class ServerStep(Protocol):
    """A method's own step on the server after aggregation (Algorithm 1, lines 9-11: FedST's
    SERQ, fedst/methods/serq.py), built by :meth:`Method.server_step`. Its state enters the
    method's entry of the server checkpoint; files of its own are written before that checkpoint
    and pruned after it."""

    def pretrain(self, iters: int) -> PretrainResult | None:
        """Line 3 when the step owns the synthetic pre-training (the result loaded into v_g):
        its final loss and cost; None: the server's plain pre-training applies."""
        ...

    def step(self, global_model: FedSTNet, server_round: int) -> dict[str, Any]:
        """Move v_g (gamma_g already aggregated into it); returns the scalars the log records."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], server_round: int) -> None:
        """Restore :meth:`state_dict` of the checkpoint of ``server_round``."""
        ...

    def save_files(self, server_round: int) -> StepFiles: ...

    def prune_files(self, server_round: int, previous_round: int | None) -> None:
        """After the checkpoint of ``server_round`` (the one before: ``previous_round``)."""
        ...

    def close(self) -> None: ...

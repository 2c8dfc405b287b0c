"""FedRep (Collins et al., ICML 2021): a shared body, a private head, trained in alternation.

Each round a site first trains its private head with the body frozen, then the body with the head
frozen (Collins et al., Algorithm 1: tau_h head updates, then tau body updates), and sends only
the body; the server averages the bodies. Here the head is the final 1x1 classifier
(fedst/methods/head.py), the body everything else.

Schedule (design note). The FedST paper trains every method with "identical training schedules"
(Sec. IV-A: the same optimizer settings and number of training iterations). FedRep's body is its
federated model, so the body trains ``train.local_iters`` E iterations per round, the same E as
every other method's model; the head phase comes before it, ``head_iters`` iterations (default
E). FedRep's own experiments gave the head 10 local epochs per body epoch; expressed inside one
budget of E iterations (round(10/11 E) head, the rest body, this module's earlier default) the
body trained 2 of every 20 iterations, a tenth of every other method's updates of the shared
model, and FedRep fell below Local. Keeping the 10:1 ratio at E body iterations would cost 10x
the other methods' compute; equal head and body counts keep FedRep's alternation with the body on
the common schedule, at about 1.3-1.5x a FedAvg round (head iterations run the full forward pass
but back-propagate into the head alone).
"""

from __future__ import annotations

from torch import nn

from fedst.methods.base import LocalPhase, Method
from fedst.methods.head import is_head, with_private_head
from fedst.model.partition import Partition
from fedst.schema.method_options import FedRepOptions


def _body(key: str) -> bool:
    return not is_head(key)


class FedRep(Method):
    """Head private; per round: head phase (body frozen), then body phase (head frozen)."""

    Options = FedRepOptions

    def partition(self, model: nn.Module) -> Partition:
        """The method's partition with the head always private."""
        return with_private_head(super().partition(model), model)

    def head_iterations(self, local_iters: int) -> int:
        """Head iterations of a round whose body trains ``local_iters`` (see FedRepOptions)."""
        return local_iters if self.options.head_iters is None else self.options.head_iters

    def local_phases(self, local_iters: int) -> list[LocalPhase]:
        """The head phase, then ``local_iters`` body iterations (every method's E)."""
        return [
            LocalPhase(self.head_iterations(local_iters), trainable=is_head, name="head"),
            LocalPhase(local_iters, trainable=_body, name="body"),
        ]

    def describe(self) -> dict:
        return {**super().describe(), "head_iters": self.options.head_iters}

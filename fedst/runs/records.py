"""The two checkpoint formats of a run directory, as typed records read from the files.

The files are written as plain dicts by the processes that own them (the server:
fedst/federation/server.py ``FederationServer.save``; a site: fedst/federation/site.py
``Site.save``; the deployed server for exported sites: fedst/app/after_rounds.py), and stay
exactly as written: a record names the fields a returned model is built from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

TensorDict = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class ServerCheckpoint:
    """``checkpoints/server.pt``: the server's state after its last completed round."""

    round: int
    """The completed round (0: none completed yet)."""
    global_model: TensorDict | None
    """v_g: every tensor of the server's network (shared gamma_g and the server's own rho_g);
    None in a finished run whose returned models do not read it (fedst/runs/footprint.py)."""
    shared_keys: tuple[str, ...]
    """The names of gamma_g within ``global_model``."""

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> ServerCheckpoint:
        return cls(
            round=int(saved["round"]),
            global_model=saved.get("global_model"),
            shared_keys=tuple(saved["shared_keys"]),
        )

    def global_shared(self) -> dict[str, torch.Tensor]:
        """gamma_g after :attr:`round`."""
        if self.global_model is None:
            raise FileNotFoundError(
                "this finished run kept the sites' own models v_k = gamma_k U rho_k and not v_g "
                "(no returned model reads gamma_g); train.keep_resume_state=true keeps it"
            )
        return {key: self.global_model[key] for key in self.shared_keys}


@dataclass(frozen=True)
class SiteState:
    """What a run keeps of one site's model after a round: ``sites/<site>/state_rNNNN.pt`` (the
    last rounds), ``sites/<site>/selection/personal_rNNNN.pt`` (every validation round) or the
    rho_k a deployed site exported at the end."""

    site: str
    personal: TensorDict
    """rho_k after the round."""
    num_examples: float
    """n_k: the site's training clips, its weight in the out-of-federation average."""
    shared: TensorDict | None = None
    """The site's own gamma_k after its last local round (None: not kept, e.g. older runs)."""
    round: int | None = None

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any], site: str | None = None) -> SiteState:
        """``site``: the site the file belongs to (a selection snapshot or an old state may not
        name it)."""
        return cls(
            site=site if site is not None else saved.get("site", "?"),
            personal=saved["personal"],
            num_examples=float(saved["num_examples"]),
            shared=saved.get("shared"),
            round=saved.get("round"),
        )

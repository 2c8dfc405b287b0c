"""What a config field is, beside its value: its *role*, declared once on the field
(``field(metadata=role(CADENCE))``) and read by the resume check (fedst/cli.py), a site's view
of the experiment and its state fingerprint (fedst/experiment/site_view.py) through
fedst.experiment.roles.

A field without a declared role is :data:`LEARNING` (most fields: what a site learns); a
section's role (``ExperimentConfig.fed``) is that of each of its fields. The roles:

================ ============================================ ================= =============
role             what the field changes                       state fingerprint on resume
================ ============================================ ================= =============
``learning``     what a site learns                           yes               refused
``measure``      what a score measures, not what is learned   no                refused
``server``       the server's handling of the sites' replies  no                refused
``cadence``      when the run evaluates or saves              no                accepted
``execution``    how a step runs on the device                no                accepted
``node``         a site's own hardware and folders            yes (default)     accepted
``resource``     memory and disk kept while training          no                accepted
================ ============================================ ================= =============

``measure`` is refused on resume although it leaves a site's state alone: a resumed run would
mix scores of two measures in its metrics and its model selection (``train.eval_max_frames``
caps the test and validation frames of every evaluation). ``node`` fields travel at their
defaults in a site's view (each site sets its own). ``resource`` fields change what a run keeps
in memory and on disk, never a number it computes, so a resume may change them and the site's
state folder is still its own: runs recorded before this rule (issue 63) fingerprinted them,
and a site still recognises those fingerprints (fedst.experiment.legacy_state_fingerprints).
"""

from __future__ import annotations

from typing import Any

LEARNING = "learning"
MEASURE = "measure"
SERVER = "server"
CADENCE = "cadence"
EXECUTION = "execution"
NODE = "node"
RESOURCE = "resource"
ROLES = (LEARNING, MEASURE, SERVER, CADENCE, EXECUTION, NODE, RESOURCE)

FINGERPRINTED_ROLES = (LEARNING, NODE)
"""Roles whose fields name what produces a site's private state (its state fingerprint)."""
LEGACY_FINGERPRINTED_ROLES = (LEARNING, NODE, RESOURCE)
"""The state fingerprint's roles before ``resource`` left it (runs recorded until issue 63)."""
RESUME_SAFE_ROLES = (CADENCE, EXECUTION, NODE, RESOURCE)
"""Roles whose fields a resumed run accepts from the command line."""


def role(name: str) -> dict[str, Any]:
    """The ``metadata`` of a dataclass field of role ``name`` (one of :data:`ROLES`)."""
    if name not in ROLES:
        raise ValueError(f"unknown field role {name!r}; choose one of {ROLES}")
    return {"role": name}

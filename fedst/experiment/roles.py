"""The role of every field of the experiment (fedst/schema/roles.py: what a field changes),
flattened to dotted keys: what the resume check (fedst/cli.py), a site's view and its state
fingerprint (fedst/experiment/site_view.py) read, instead of lists of their own."""

from __future__ import annotations

import dataclasses
import functools
import typing

from fedst.experiment.config import ExperimentConfig
from fedst.schema.roles import FINGERPRINTED_ROLES, LEARNING, RESUME_SAFE_ROLES


@functools.cache
def field_roles(cls: type = ExperimentConfig, prefix: str = "", inherited: str = LEARNING) -> dict:
    """``{"train.eval_every": "cadence", ...}``: every leaf field of ``cls`` (a field holding a
    config dataclass is a section: its fields are listed, with the section's role unless they
    declare their own) with the role its ``metadata`` declares (:data:`LEARNING` if none)."""
    roles: dict[str, str] = {}
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        key = f"{prefix}{item.name}"
        declared = item.metadata.get("role", inherited)
        if dataclasses.is_dataclass(hints[item.name]):
            roles.update(field_roles(hints[item.name], f"{key}.", declared))
        else:
            roles[key] = declared
    return roles


def keys_of_roles(*roles: str) -> tuple[str, ...]:
    """The dotted keys of the experiment's fields of these roles, in declaration order."""
    return tuple(key for key, found in field_roles().items() if found in roles)


def resume_safe_keys() -> tuple[str, ...]:
    """Keys a resumed run accepts from the command line (fedst.schema.roles.RESUME_SAFE_ROLES)."""
    return keys_of_roles(*RESUME_SAFE_ROLES)


def unfingerprinted_keys(fingerprinted: tuple[str, ...] = FINGERPRINTED_ROLES) -> tuple[str, ...]:
    """Keys left out of a site's state fingerprint (the roles outside ``fingerprinted``:
    FINGERPRINTED_ROLES, or the legacy rule's)."""
    return tuple(key for key, found in field_roles().items() if found not in fingerprinted)

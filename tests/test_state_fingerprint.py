"""Specification of which settings own a site's private state (fedst/experiment/site_view.py).

* execution settings (compile mode, channels_last, deterministic kernels, require_gpu), the
  unseen-site indicator rule and the server's reply handling (``fed.*``) do not change the state
  fingerprint: a run resumes with others;
* a state folder written before those fields existed (``train.compile`` a bool, no
  channels_last, deterministic, require_gpu or indicator.unseen) is still claimed by the same
  configuration;
* a setting that changes what a site learns (the learning rate) is still refused;
* the resource fields (what a run keeps in memory and on disk) leave it too, and a state
  folder whose fingerprint still holds them (recorded until issue 63) is claimed by the same
  configuration.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from fedst.experiment import field_roles, site_view, state_fingerprint
from fedst.federation.site import StateMismatchError, claim_state_dir
from fedst.runs.layout import STATE_FINGERPRINT
from tests.test_federation import experiment


def _train(cfg, **changes):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **changes))


def values_before_roles(cfg) -> dict:
    """A site view's values that the code before issue 63 fingerprinted (its lists: the
    evaluation and execution fields, the selection rule and metric, method.returned_model,
    indicator.unseen and the fed section left out)."""
    values = json.loads(site_view(cfg).to_json())
    for key in ("eval_every", "eval_max_frames", "val_every", "eval_batch_size"):
        values["train"].pop(key)
    for key in ("distance_metrics_every", "checkpoint_every"):
        values["train"].pop(key)
    for key in ("rule", "metric"):
        values["selection"].pop(key)
    values["method"].pop("returned_model")
    for key in ("compile", "channels_last", "deterministic", "require_gpu"):
        values["train"].pop(key)
    values["indicator"].pop("unseen")
    values.pop("fed")  # the server's reply handling (issue 45)
    values["data"].pop("cache_dir")  # the frame cache (issue 60): later, of role execution
    return values


def digest(values: dict) -> str:
    return hashlib.sha1(json.dumps(values, sort_keys=True).encode()).hexdigest()[:12]


RESOURCE_CHANGES = {  # each resource field (fedst/schema/roles.py) -> a value other than the tiny's
    "train.keep_resume_state": True,
    "serq.bank_storage": "disk",
    "network.encoder_grad_checkpointing": True,
}


def with_changes(cfg, changes: dict):
    """``cfg`` with the dotted ``section.field`` keys of ``changes`` set."""
    for key, value in changes.items():
        section, name = key.split(".")
        part = dataclasses.replace(getattr(cfg, section), **{name: value})
        cfg = dataclasses.replace(cfg, **{section: part})
    return cfg


def without_resources(values: dict) -> dict:
    """Fingerprinted values by today's rule from :func:`values_before_roles` (which kept the
    resource fields, as the code before issue 63 did)."""
    for key in RESOURCE_CHANGES:
        section, name = key.split(".")
        values[section].pop(name)
    return values


def old_format_fingerprint(cfg) -> str:
    """The fingerprint as runs recorded it before issue 33 and 37 (by the rule of that code:
    no execution fields, ``train.compile`` a bool)."""
    values = values_before_roles(cfg)
    values["train"]["compile"] = False
    return digest(values)


def test_execution_settings_the_unseen_rule_and_reply_handling_leave_the_fingerprint(tmp_path):
    cfg = experiment(tmp_path)
    changed = _train(cfg, compile="reduce-overhead", channels_last=True, deterministic=False)
    changed = dataclasses.replace(
        changed,
        indicator=dataclasses.replace(changed.indicator, unseen="mean"),
        fed=dataclasses.replace(changed.fed, max_update_ratio=10.0, trim_fraction=0.2),
    )
    assert state_fingerprint(site_view(changed)) == state_fingerprint(site_view(cfg))
    assert state_fingerprint(site_view(_train(cfg, lr=cfg.train.lr * 2))) != state_fingerprint(
        site_view(cfg)
    )


def test_a_state_folder_from_before_the_execution_fields_is_claimed_by_the_same_config(tmp_path):
    cfg = _train(experiment(tmp_path), compile="none")
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    record = {"fingerprint": old_format_fingerprint(cfg), "site": "A", "config": {}}
    (state_dir / STATE_FINGERPRINT).write_text(json.dumps(record))
    claim_state_dir(state_dir, "A", cfg)  # no StateMismatchError
    with pytest.raises(StateMismatchError, match="site A"):
        claim_state_dir(state_dir, "A", _train(cfg, lr=cfg.train.lr * 2))


def test_resource_fields_leave_the_fingerprint_so_a_resume_may_change_them(tmp_path):
    """A resume accepts the resource fields (tests/test_field_roles.py); the sites' state folders
    must accept them too, so none of them may enter the state fingerprint."""
    resources = {key for key, role in field_roles().items() if role == "resource"}
    assert resources == set(RESOURCE_CHANGES)  # a new resource field: add a change above
    cfg = experiment(tmp_path)
    for key, value in RESOURCE_CHANGES.items():
        changed = with_changes(cfg, {key: value})
        assert changed != cfg, key
        assert state_fingerprint(site_view(changed)) == state_fingerprint(site_view(cfg)), key
    state_dir = tmp_path / "state"
    claim_state_dir(state_dir, "A", cfg)
    claim_state_dir(state_dir, "A", with_changes(cfg, RESOURCE_CHANGES))  # the resumed run


def test_a_state_folder_whose_fingerprint_holds_the_resource_fields_is_claimed(tmp_path):
    """Runs until issue 63 fingerprinted the resource fields: the same configuration (with the
    resource values it recorded) still claims their state folders."""
    cfg = with_changes(experiment(tmp_path), {"serq.bank_storage": "disk"})
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    record = {"fingerprint": digest(values_before_roles(cfg)), "site": "A", "config": {}}
    assert record["fingerprint"] != state_fingerprint(site_view(cfg))
    (state_dir / STATE_FINGERPRINT).write_text(json.dumps(record))
    claim_state_dir(state_dir, "A", cfg)  # no StateMismatchError
    with pytest.raises(StateMismatchError, match="site A"):
        claim_state_dir(state_dir, "A", _train(cfg, lr=cfg.train.lr * 2))

"""Every field of the experiment has a role (fedst/schema/roles.py), declared on the field and
read by the resume check, a site's view and its state fingerprint (issue 63). The table below
names every field: a new field fails this test until it is listed with the role it was given,
so that whether it may change on resume and whether it owns a site's state is decided once."""

from __future__ import annotations

import dataclasses

from fedst.cli import compose_experiment, resume_experiment
from fedst.experiment import (
    field_roles,
    legacy_state_fingerprints,
    resume_safe_keys,
    site_view,
    state_fingerprint,
)
from tests.test_state_fingerprint import digest, values_before_roles, without_resources

LEARNING_FIELDS = {  # section -> its fields of role "learning", space separated
    "": "name seed",
    "data": (
        "sites federation out_of_federation server mix_synthetic root "
        "procedural generator_version val_split val_videos val_seed partition "
        "partition_seed"
    ),
    "method": (
        "name algorithm options personalization personal_patterns "
        "personalize_channel_selection shared_components temporal prompt "
        "channel_selection indicator serq synthetic_pretraining aggregation "
        "aggregation_weights communicate"
    ),
    "train": (
        "rounds local_iters total_iters batch_size lr weight_decay lambda_dice "
        "amp_dtype tf32 cudnn_benchmark max_grad_norm temporal_lr_mult "
        "norm_weight_decay lr_schedule warmup_iters clip_frame_loss_weight"
    ),
    "pretraining": "iters batch_size lr",
    "serq": (
        "mode batches_per_round batch_size lr lambda_eq lambda_sc ema_mu "
        "feature_stage descriptor_step"
    ),
    "network": (
        "encoder pretrained weights_dir drop_path_rate num_classes decoder_dim "
        "temporal temporal_stages window_size receptive_fields pool_sizes "
        "temporal_variant temporal_tokens_per_window temporal_context_tokens "
        "temporal_alignment temporal_position_bias temporal_target_ring "
        "temporal_target_pooled temporal_mlp_ratio temporal_placement prompt channel_selection "
        "channel_selection_kind cs_stages indicator_dim detach_previous_frames"
    ),
    "clip": "num_frames interval_s image_size single_frame_mode",
    "augment": ("enabled rotate_limit_deg scale_limit hflip vflip color_jitter hue blur_sigma"),
    "indicator": "clip_model clip_pretrained dim",
    "comm": "precision",
    "privacy": "dp noise_multiplier clipping_norm target_clipped_quantile clip_norm_lr",
    "selection": "held_out_site",
}
OTHER_ROLES = {
    # what a score measures: out of the fingerprint, refused on resume (a run's metrics and
    # its selection would mix two measures; eval_max_frames caps every evaluation's frames)
    "train.eval_max_frames": "measure",
    "method.returned_model": "measure",
    "indicator.unseen": "measure",
    "selection.rule": "measure",
    "selection.metric": "measure",
    # the server's reply handling (the fed section's role)
    "fed.max_update_ratio": "server",
    "fed.max_data_change": "server",
    "fed.trim_fraction": "server",
    # when the run evaluates or saves, and in what batches it scores
    "train.eval_every": "cadence",
    "train.val_every": "cadence",
    "train.eval_batch_size": "cadence",
    "train.distance_metrics_every": "cadence",
    "train.checkpoint_every": "cadence",
    # how a step runs on the device
    "train.compile": "execution",
    "train.channels_last": "execution",
    "train.deterministic": "execution",
    "train.require_gpu": "execution",
    "data.cache_dir": "execution",  # the same pixels, preprocessed: out of the fingerprint
    # each site's own (its view carries the defaults)
    "train.device": "node",
    "train.num_workers": "node",
    "indicator.cache_dir": "node",
    # memory and disk while training (out of the fingerprint; runs until issue 63 had them in)
    "train.keep_resume_state": "resource",
    "serq.bank_storage": "resource",
    "network.encoder_grad_checkpointing": "resource",
}


def test_every_field_of_the_experiment_has_the_listed_role():
    expected = {
        f"{section}.{name}" if section else name: "learning"
        for section, names in LEARNING_FIELDS.items()
        for name in names.split()
    }
    assert not set(expected) & set(OTHER_ROLES)
    expected.update(OTHER_ROLES)
    assert field_roles() == expected


def test_a_resume_accepts_exactly_the_cadence_execution_node_and_resource_fields(tmp_path):
    accepted = {k for k, r in OTHER_ROLES.items() if r not in ("measure", "server")}
    assert set(resume_safe_keys()) == accepted
    saved, _ = compose_experiment(["experiment=tiny"], method_checked=False)
    composed, _ = compose_experiment(
        ["experiment=tiny", "train.eval_every=3", "indicator.cache_dir=elsewhere"],
        method_checked=False,
    )
    resumed = resume_experiment(
        saved, composed, ["train.eval_every=3", "indicator.cache_dir=elsewhere"]
    )
    assert resumed.train.eval_every == 3 and resumed.indicator.cache_dir == "elsewhere"


def test_the_state_fingerprint_read_from_roles_is_the_recorded_one_without_the_resources():
    """The fingerprint is the one runs recorded before roles existed, without the resource
    fields (issue 63); that old one is still among the legacy fingerprints a site accepts."""
    for overrides in (["experiment=tiny"], ["experiment=demo", "method=fedavg"]):
        cfg, _ = compose_experiment(overrides, method_checked=False)
        cfg = dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, device="cpu", num_workers=0)
        )
        recorded = values_before_roles(cfg)
        assert digest(recorded) in legacy_state_fingerprints(site_view(cfg))
        assert state_fingerprint(site_view(cfg)) == digest(without_resources(recorded))

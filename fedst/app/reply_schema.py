"""The reply schema the server owns: for each message kind, the fields a site's reply must carry
(with their kind and range) and those it may carry. :func:`screen` applies it to one reply before
anything else reads the reply (``SiteGrid.ask``, every engine): a missing or ill-kinded required
field, or a known field out of its range, is a ``schema`` refusal naming the field; a field the
schema does not know is dropped (the caller logs it once per site), never fatal, so a site that
sends more (a GPU site's memory peaks beside CPU sites, a newer FedST's metric) still takes part.

The table of docs/deployment.md ("Reply schema") lists these fields; tests/test_reply_boundary.py
and tests/test_reply_fuzz.py check the boundary.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedst.accel import REPLY_MEMORY_KEYS
from fedst.app import keys
from fedst.methods.reply_fields import ReplyField
from fedst.scoring.evaluation import METRICS_RECORD
from fedst.scoring.metrics import CHALLENGE_METRIC_NAMES, SUMMARY_METRIC_NAMES


@dataclass(frozen=True)
class RecordSchema:
    """The fields of one record: ``required``, ``optional`` and ``patterned`` (regular
    expression of the key -> the field's rule, e.g. per-class scores ``<class>/dice``)."""

    required: tuple[ReplyField, ...] = ()
    optional: tuple[ReplyField, ...] = ()
    patterned: tuple[tuple[str, ReplyField], ...] = ()

    def field_of(self, key: str) -> ReplyField | None:
        for rule in (*self.required, *self.optional):
            if rule.key == key:
                return rule
        for pattern, rule in self.patterned:
            if re.fullmatch(pattern, key):
                return rule
        return None


@dataclass(frozen=True)
class ReplySchema:
    """What a reply of one message kind carries: its "site" ConfigRecord and its MetricRecords
    (``metrics_required``: whether a reply without any is refused; ``scored_records``: evaluate
    replies, one record per scored split, ``metrics`` or ``metrics@<site>``)."""

    site: RecordSchema
    metrics: RecordSchema = field(default_factory=RecordSchema)
    metrics_required: bool = True
    scored_records: bool = False
    when_shared: tuple[str, ...] = ()
    """Records required when the "site" record says ``shared: 1`` (rho_k was sent)."""


def _whole(key: str, low: float = 0) -> ReplyField:
    return ReplyField(key, "int", low=low)


def _seconds(key: str) -> ReplyField:
    return ReplyField(key, "float", low=0)


SITE_NAME = ReplyField(keys.SITE_NAME, "text")
SITE_ROUND = _whole(keys.SITE_ROUND)
IDENTITY = (SITE_NAME, SITE_ROUND)
"""Every reply names its site and the round it answers (the ``site`` and ``round`` checks then
compare them with the federation and the instruction)."""

TRAIN_METRICS_OPTIONAL = (
    _seconds(keys.LOADER_SECONDS),
    _whole(keys.PROCESS_ID),
    ReplyField(keys.SITE_BUILT, "flag"),
    _whole(keys.STATE_RESTORES),
    *(_whole(key) for key in REPLY_MEMORY_KEYS),
)
"""Sites before issue 59 also sent "uniform-weight": 1; unknown now, it is dropped like any other
key the schema does not list (the server computes every weight)."""

PERCENT_SCORES = ("dice", "iou", *CHALLENGE_METRIC_NAMES)
"""Scores that travel in percent (fedst/scoring/metrics.py SegmentationMeter.summary)."""
SCORE_FIELDS = tuple(
    ReplyField(name, "float", low=0, high=100 if name in PERCENT_SCORES else None)
    for name in SUMMARY_METRIC_NAMES
)
EVALUATE_METRICS = RecordSchema(
    required=(_whole(keys.NUM_EXAMPLES),),
    optional=SCORE_FIELDS,
    patterned=(
        *((rf"[^/]+/{rule.key}", rule) for rule in SCORE_FIELDS),
        (r"[^/]+/frames", _whole("<class>/frames")),
    ),
)


def reply_schemas(declared: Sequence[ReplyField] = ()) -> dict[str, ReplySchema]:
    """Message kind -> its reply schema; ``declared``: the method's own train-reply scalars
    (``Method.reply_scalars``), required in its train replies."""
    train_metrics = RecordSchema(
        required=(
            _whole(keys.NUM_EXAMPLES),
            ReplyField(keys.TRAIN_LOSS, "float"),
            _seconds(keys.SECONDS),
            *declared,
        ),
        optional=TRAIN_METRICS_OPTIONAL,
    )
    shared_flag = RecordSchema(required=(*IDENTITY, ReplyField(keys.SHARED, "flag")))
    personal = ReplySchema(
        site=shared_flag,
        metrics=RecordSchema(required=(_whole(keys.NUM_EXAMPLES),)),
        metrics_required=False,  # a site that declines sends neither
        when_shared=(keys.METRICS, keys.PERSONAL),
    )
    return {
        MessageType.TRAIN: ReplySchema(
            site=RecordSchema(
                required=IDENTITY,
                optional=(_whole(keys.DATA_SIZE), ReplyField(keys.DATA_CHANGED, "flag")),
            ),
            metrics=train_metrics,
        ),
        MessageType.EVALUATE: ReplySchema(
            site=RecordSchema(required=IDENTITY), metrics=EVALUATE_METRICS, scored_records=True
        ),
        keys.QUERY_PERSONAL: personal,
        keys.QUERY_PERSONAL_EXCHANGE: personal,
        keys.TRAIN_FINAL_STAGE: ReplySchema(
            site=RecordSchema(required=IDENTITY),
            metrics=RecordSchema(
                required=(
                    _whole(keys.NUM_EXAMPLES),
                    _seconds(keys.SECONDS),
                    _whole(keys.ENSEMBLE_SIZE, low=1),
                ),
                optional=(ReplyField(keys.TRAIN_LOSS, "float"), _whole(keys.ITERATIONS)),
            ),
        ),
    }


@dataclass
class Screened:
    """A reply after :func:`screen`: the problem that refuses it (None: accepted), its content
    with only the fields the schema knows, and the keys dropped ("<record>:<key>")."""

    problem: str | None
    content: RecordDict | None = None
    dropped: list[str] = field(default_factory=list)


def _screen_record(
    name: str, record: ConfigRecord | MetricRecord, schema: RecordSchema, dropped: list[str]
) -> tuple[str | None, dict]:
    """(problem, the known fields) of one record against ``schema``."""
    kept = {}
    for key, value in record.items():
        rule = schema.field_of(key)
        if rule is None:
            dropped.append(f"{name}:{key}")
            continue
        problem = rule.problem(value)
        if problem is not None:
            return f"record {name!r}: {problem}", {}
        kept[key] = value
    missing = [rule.key for rule in schema.required if rule.key not in record]
    if missing:
        return f"record {name!r} lacks {', '.join(map(repr, missing))}", {}
    return None, kept


def screen(reply: Message, schema: ReplySchema) -> Screened:
    """Check ``reply`` (not an error reply) against ``schema``; never raises."""
    content, dropped = reply.content, []
    site = content.config_records.get(keys.SITE)
    if site is None:
        return Screened("it has no 'site' record naming its site and round")
    problem, site_fields = _screen_record(keys.SITE, site, schema.site, dropped)
    if problem is not None:
        return Screened(problem)
    records: dict = {keys.SITE: ConfigRecord(site_fields)}
    metric_names = [
        name
        for name in content.metric_records
        if (name == METRICS_RECORD or name.startswith(f"{METRICS_RECORD}@"))
        and (schema.scored_records or name == keys.METRICS)
    ]
    dropped += [f"{name}:*" for name in content.metric_records if name not in metric_names]
    if schema.metrics_required and not metric_names:
        return Screened(f"it has no {keys.METRICS!r} record")
    if site_fields.get(keys.SHARED) == 1:
        present = {*metric_names, *content.array_records}
        lacking = [name for name in schema.when_shared if name not in present]
        if lacking:
            return Screened(f"it says it shared rho_k but has no record {', '.join(lacking)}")
    for name in metric_names:
        problem, kept = _screen_record(name, content.metric_records[name], schema.metrics, dropped)
        if problem is not None:
            return Screened(problem)
        records[name] = MetricRecord(kept)
    records.update({n: r for n, r in content.array_records.items()})
    records.update({n: r for n, r in content.config_records.items() if n != keys.SITE})
    return Screened(None, RecordDict(records), dropped)

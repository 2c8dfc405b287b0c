"""The ServerApp's side of the wire. :class:`SiteGrid` is the server's conversation with the
sites: ``ask(kind, payload, config, round)`` sends one message kind to the connected nodes and
returns the checked replies in federation order: every reply's round and site, and for a training
step each update's tensors, sample count and norm (fedst/federation/reply_checks.py), after the
reply schema the server owns (fedst/app/reply_schema.py: every field's kind and range; a field it
does not know is dropped and logged once per site); a refused reply is a dropped site, logged
(train.jsonl, wire.jsonl) with its check and reason. The server computes each accepted training
reply's aggregation weight itself (``Replies.weights``). Beneath it:
:func:`broadcast` collects replies (a failure, a silent node or parameters that cannot be
unpacked is returned, not raised), polling the SuperLink every ``deploy.reply_poll`` seconds; the
wire audit (wire.jsonl); waiting for the nodes to connect; :func:`learn_sites`, which learns
which node is which site and orders the replies by federation; and :func:`require_sites`, which
stops the run (:class:`FederationError`) when fewer than ``RoundPolicy.min_sites`` answered."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedst.app import keys
from fedst.app.reply_schema import ReplySchema, reply_schemas, screen
from fedst.errors import UserError
from fedst.experiment import RoundPolicy
from fedst.federation import transport
from fedst.federation.reply_checks import Refusal, ReplyChecker, Update, identity_problem
from fedst.runs.files import RunLog

log = logging.getLogger("fedst.app.server_app")  # the ServerApp's log, as before the split


class FederationError(UserError, RuntimeError):
    """Too few sites answered a round (or a node claimed a site it is not): the run stops here.
    Not a bug of this process: the entry point prints the one-line reason (each failed site and
    the first line of its error; the whole errors are in the log) and exits 2; the run resumes
    from its last completed round (``train_fed.py resume=<run>``)."""


class Replies:
    """The replies of one broadcast: the accepted replies; by node, what failed, stayed silent or
    was refused; every refusal; and, of a checked training step, each accepted site's gamma_k
    (fp32) and update norm."""

    def __init__(self) -> None:
        self.replies: list[Message] = []
        self.failed: dict[int, str] = {}
        self.refused: list[Refusal] = []
        self.claimed: dict[int, str] = {}
        """Node -> the site its refused reply named (for the failure lines)."""
        self.states: dict[str, dict[str, torch.Tensor]] = {}
        self.norms: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        """Site -> the aggregation weight the server computed (summing to 1 over the step)."""

    def refuse(self, node: int | None, refusal: Refusal) -> None:
        """Record ``refusal``; with ``node`` (its reply was that node's answer) the node is left
        out of the step like a failed one."""
        self.refused.append(refusal)
        if node is not None:
            self.failed[node] = f"reply refused ({refusal.check} check): {refusal.reason}"
            self.claimed[node] = refusal.site


def broadcast(
    grid: Grid,
    nodes: list[int],
    kind: str,
    payload: transport.Packed,
    config: dict[str, Any],
    server_round: int,
    timeout: float | None = None,
    first_payloads: dict[int, transport.Packed] | None = None,
    audit: RunLog | None = None,
    records: dict[int, dict[str, transport.Packed]] | None = None,
    poll: float = RoundPolicy.reply_poll,
) -> Replies:
    """Send ``payload`` (record "arrays") and config to every node (``first_payloads`` overrides
    the payload per node, ``records`` adds named packed records per node) and collect the
    replies; failures, silent nodes and replies whose parameters cannot be unpacked are
    returned, not raised."""
    messages = [
        Message(
            RecordDict(
                {
                    **(first_payloads or {}).get(node, payload).records(keys.ARRAYS),
                    keys.CONFIG: ConfigRecord(config),
                    **{
                        part: record
                        for name, packed in (records or {}).get(node, {}).items()
                        for part, record in packed.records(name).items()
                    },
                }
            ),
            dst_node_id=node,
            message_type=kind,
            group_id=str(server_round),
            ttl=timeout,  # a site that comes back later does not work on a closed step
        )
        for node in nodes
    ]
    if audit is not None:
        for message in messages:
            _audit(audit, "down", message, server_round)
    result = Replies()
    answered, seen = set(), set()
    replies = _send_and_receive(grid, messages, timeout, poll)
    # the SuperLink's own error replies (e.g. node unavailable) do not come from the node:
    # match each reply to its instruction
    node_of = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
    for reply in replies:
        message_id = reply.metadata.reply_to_message_id
        node = node_of.get(message_id)
        if audit is not None:
            _audit(audit, "up", reply, server_round)
        if reply.has_error():
            node = reply.metadata.src_node_id if node is None else node
            answered.add(node)
            result.failed[node] = reply.error.reason
            continue
        if node is None or message_id in seen:  # never aggregated, whatever it carries
            what = "no message of this step" if node is None else "a message a second time"
            result.refuse(None, Refusal(_claimed_site(reply), "round", f"it answers {what}"))
            continue
        seen.add(message_id)
        answered.add(node)
        if (refusal := _wire_refusal(reply)) is not None:
            result.refuse(node, refusal)
        else:
            result.replies.append(reply)
    for node in set(nodes) - answered:
        result.failed[node] = f"no reply within {timeout} s"
    return result


def _send_and_receive(
    grid: Grid, messages: list[Message], timeout: float | None, poll: float
) -> list[Message]:
    """Flower's ``Grid.send_and_receive`` with a pause of ``poll`` seconds between two requests
    for the replies (``deploy.reply_poll``) instead of its fixed 3 s: push the messages, then pull
    until every one has its reply or ``timeout`` seconds have passed."""
    pending = {message_id for message_id in grid.push_messages(messages) if message_id}
    deadline = None if timeout is None else time.monotonic() + timeout
    replies: list[Message] = []
    while pending:
        pulled = list(grid.pull_messages(sorted(pending)))
        replies += pulled
        pending -= {reply.metadata.reply_to_message_id for reply in pulled}
        if not pending or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(poll)
    return replies


def _wire_refusal(reply: Message) -> Refusal | None:
    """Why the parameters of a reply cannot be unpacked (older layout, unknown manifest), or None."""
    try:
        for name in reply.content.array_records:
            transport.received(reply.content, name)
    except transport.WireFormatError as err:
        return Refusal(_claimed_site(reply), "wire", str(err))
    return None


def _claimed_site(reply: Message) -> str:
    """The site a reply says it comes from, else its node."""
    info = reply.content.config_records.get(keys.SITE)
    if info is not None and isinstance(info.get(keys.SITE_NAME), str):
        return info[keys.SITE_NAME]
    return f"node {reply.metadata.src_node_id}"


def _audit(runlog: RunLog, direction: str, message: Message, server_round: int) -> None:
    """One wire.jsonl row: what a message carried (record names; per packed record the keys and
    shapes its manifest lists, checked against its buffers; never values). A reply whose
    manifest does not match its buffers is logged with the reason it was refused."""
    row: dict[str, Any] = {
        "round": server_round,
        "direction": direction,
        "type": message.metadata.message_type,
        "node": message.metadata.dst_node_id
        if direction == "down"
        else message.metadata.src_node_id,
    }
    if not message.has_error():
        content = message.content
        try:
            row["arrays"] = transport.describe(content)
        except transport.WireFormatError as err:
            row["refused"] = str(err)
        row["configs"] = {
            name: sorted(record.keys()) for name, record in content.config_records.items()
        }
        row["metrics"] = {
            name: sorted(record.keys()) for name, record in content.metric_records.items()
        }
        if direction == "down" and keys.CONFIG in content:
            row["config_values"] = {k: v for k, v in content[keys.CONFIG].items()}
    runlog.write("wire", row)


def site_of(reply: Message) -> str:
    return str(reply.content[keys.SITE][keys.SITE_NAME])


def node_sites(grid: Grid, sites_of: dict[int, str]) -> dict[int, str]:
    """Node id -> site of the connected nodes that can be told apart: learnt from their replies,
    else the name their key was registered under (deployment: ``flwr supernode register --name
    <site>``, which the SuperLink reports in its node list before the node ever answers)."""
    named = {}
    for info in grid.get_nodes():
        name = getattr(info, "name", "") or ""  # Flower's NodeInfo: "" when not registered
        if name:
            named[int(info.node_id)] = name
    return {**named, **sites_of}


def wait_for_nodes(
    grid: Grid,
    expected: int,
    timeout: float,
    federation: list[str],
    sites_of: dict[int, str] | None = None,
    required: int | None = None,
) -> list[int]:
    """The connected nodes, after waiting up to ``timeout`` s for ``expected`` of them; fewer than
    ``required`` (default: ``expected``) stops the run with the sites still missing."""
    required = expected if required is None else required
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= expected or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    if len(nodes) < required:
        site_of_node = node_sites(grid, sites_of or {})
        connected = [s for s in federation if s in {site_of_node.get(n) for n in nodes}]
        unknown = len(nodes) - len(connected)  # connected, but which site is not known yet
        missing = [s for s in federation if s not in connected]
        parts = [
            f"{len(nodes)} of {expected} sites connected after {timeout:.0f} s (need {required})"
        ]
        if connected:
            parts.append(f"connected: {', '.join(connected)}")
        if unknown:
            parts.append(
                f"{unknown} connected node(s) not identified yet; "
                f"{len(missing) - unknown} of {', '.join(missing)} not connected"
            )
        else:
            parts.append(f"not connected: {', '.join(missing)}")
        raise FederationError(
            "; ".join(parts) + ". Start them with: python train_fed.py site=<name> "
            "deploy.server=<host:port>"
        )
    if len(nodes) < expected:
        log.warning("%d of %d sites connected; going on with them", len(nodes), expected)
    return nodes


def learn_sites(result: Replies, sites_of: dict[int, str], federation: list[str]) -> None:
    """Learn node -> site from the accepted replies (two nodes claiming one site stop the run)
    and put the replies in federation order."""
    seen: dict[str, int] = {}
    for reply in result.replies:
        node, site = reply.metadata.src_node_id, site_of(reply)
        if site not in federation:
            raise FederationError(f"node {node} says it is site {site!r}, not in {federation}")
        if site in seen:
            raise FederationError(
                f"two SuperNodes ({seen[site]} and {node}) claim site {site}: give each hospital "
                f"its own site-name and key"
            )
        seen[site] = node
        sites_of[node] = site
    # federation order, not arrival order: the floating-point sum of the aggregation (and the
    # logs) must not depend on which site answered first
    result.replies.sort(key=lambda reply: federation.index(site_of(reply)))


def require_sites(
    result: Replies, sites_of: dict[int, str], min_sites: int, kind: str, server_round: int
) -> None:
    """Stop the run (naming every failure and refusal) when fewer than ``min_sites`` answered;
    else log who was left out."""
    failures = [
        f"{sites_of.get(n) or result.claimed.get(n) or f'node {n}'}: {reason}"
        for n, reason in result.failed.items()
    ]
    if len(result.replies) < min_sites:
        for failure in failures:  # the whole error texts (a site's traceback, Ray's report)
            log.error("round %d %s: %s", server_round, kind, failure)
        firsts = "; ".join(failure.strip().splitlines()[0] for failure in failures)
        raise FederationError(
            f"{len(failures)} site(s) failed during {kind} of round {server_round} and only "
            f"{len(result.replies)} answered (deploy.min_sites={min_sites}): {firsts}. The run "
            f"keeps its last completed round: resume it with train_fed.py resume=<run dir>"
        )
    for failure in failures:
        log.warning("round %d %s: left out %s", server_round, kind, failure.splitlines()[0])


class SiteGrid:
    """The server's conversation with the sites: Flower's grid, the federation in its order, the
    round policy (timeouts, ``min_sites``, reply polling), the checks of the replies
    (``checker``), the wire audit, the run log that records refusals (train.jsonl) and which node
    is which site (learnt from the replies)."""

    def __init__(
        self,
        grid: Grid,
        federation: Sequence[str],
        policy: RoundPolicy,
        audit: RunLog | None = None,
        checker: ReplyChecker | None = None,
        runlog: RunLog | None = None,
    ) -> None:
        self.grid = grid
        self.federation = list(federation)
        self.policy = policy
        self.audit = audit
        self.checker = checker or ReplyChecker()
        self.schemas: dict[str, ReplySchema] = reply_schemas(self.checker.declared)
        self.runlog = runlog
        self._dropped_noted: set[tuple[str, str, str]] = set()
        """(site, kind, key) of the unknown reply fields already logged (once per site)."""
        self.min_sites = policy.min_sites or len(self.federation)
        if self.min_sites > len(self.federation):
            raise FederationError(
                f"deploy.min_sites={self.min_sites} but the federation has "
                f"{len(self.federation)} sites"
            )
        self.sites_of: dict[int, str] = {}
        """Node id -> site, learnt from the sites' replies."""
        self.nodes: list[int] = []
        """The nodes connected at the last :meth:`connect`."""

    def connect(self, required: int | None = None) -> list[int]:
        """Wait up to ``policy.join_timeout`` s for every site's node; fewer than ``required``
        (default ``min_sites``) stops the run naming the sites still missing."""
        self.nodes = wait_for_nodes(
            self.grid,
            len(self.federation),
            self.policy.join_timeout,
            self.federation,
            self.sites_of,
            required=self.min_sites if required is None else required,
        )
        return self.nodes

    def known_nodes(self) -> list[int]:
        """The connected nodes whose site is known (they have answered once)."""
        return [node for node in self.nodes if node in self.sites_of]

    def ask(
        self,
        kind: str,
        payload: transport.Packed,
        config: dict[str, Any],
        server_round: int,
        what: str,
        nodes: list[int] | None = None,
        first_payloads: dict[int, transport.Packed] | None = None,
        records: dict[int, dict[str, transport.Packed]] | None = None,
        check: bool = True,
        reference: dict[str, torch.Tensor] | None = None,
    ) -> Replies:
        """Send ``kind`` (payload in "arrays", ``config``) to ``nodes`` (default: the connected
        ones) and collect the replies within the policy's timeout (``eval_timeout`` for an
        evaluation, ``round_timeout`` otherwise). Every reply must answer the round of
        ``config`` as the site its node is; with ``reference`` (gamma_g^t of a training step)
        each reply's gamma_k is checked against it and kept in ``Replies.states``. A refused
        reply is left out like a failed site and logged. With ``check``, the replies come back in
        federation order and fewer than ``min_sites`` stops the run naming ``what`` failed."""
        timeout = (
            self.policy.eval_timeout if kind == MessageType.EVALUATE else self.policy.round_timeout
        )
        replies = broadcast(
            self.grid,
            self.nodes if nodes is None else nodes,
            kind,
            payload,
            config,
            server_round,
            timeout=timeout,
            poll=self.policy.reply_poll,
            first_payloads=first_payloads,
            audit=self.audit,
            records=records,
        )
        self._screen(replies, kind)
        self._check_identity(replies, int(config[keys.SERVER_ROUND]))
        if check:
            learn_sites(replies, self.sites_of, self.federation)
        if reference is not None:
            self._check_updates(replies, reference)
        self._log_refusals(replies, server_round, what)
        if check:
            require_sites(replies, self.sites_of, self.min_sites, what, server_round)
        return replies

    def _screen(self, result: Replies, kind: str) -> None:
        """The reply schema of ``kind`` (fedst/app/reply_schema.py) on every reply: a reply
        outside it is refused (``schema`` check); the fields it does not know are dropped from
        the reply, and logged once per site and kind."""
        schema = self.schemas.get(kind)
        if schema is None:  # a kind the server never sends
            return
        kept = []
        for reply in result.replies:
            node, claimed = reply.metadata.src_node_id, _claimed_site(reply)
            screened = screen(reply, schema)
            if screened.problem is not None:
                site = self.sites_of.get(node, claimed)
                result.refuse(node, Refusal(site, "schema", f"{screened.problem} ({kind} reply)"))
                continue
            reply.content = screened.content
            for key in screened.dropped:
                if (claimed, kind, key) not in self._dropped_noted:
                    self._dropped_noted.add((claimed, kind, key))
                    log.warning(
                        "site %s: its %s replies carry %s, which the server's reply schema does "
                        "not know: dropped (logged once per site)",
                        claimed,
                        kind,
                        key,
                    )
            kept.append(reply)
        result.replies = kept

    def _check_identity(self, result: Replies, expected_round: int) -> None:
        """Refuse the replies that do not answer ``expected_round`` as their node's site."""
        kept = []
        for reply in result.replies:
            node, info = reply.metadata.src_node_id, reply.content.config_records.get(keys.SITE)
            if info is None or keys.SITE_NAME not in info:
                result.refuse(node, Refusal(f"node {node}", "site", "it names no site"))
                continue
            site = str(info[keys.SITE_NAME])
            declared = int(info[keys.SITE_ROUND]) if keys.SITE_ROUND in info else None
            known = self.sites_of.get(node)
            problem = identity_problem(site, declared, expected_round, self.federation, known)
            if problem is None:
                kept.append(reply)
            else:  # named as the site its node is, when known
                result.refuse(node, Refusal(known or site, *problem))
        result.replies = kept

    def _check_updates(self, result: Replies, reference: dict[str, torch.Tensor]) -> None:
        """The checks of the training replies' gamma_k (fedst/federation/reply_checks.py)."""
        updates, node_of, unreadable = {}, {}, set()
        for reply in result.replies:
            site, info = site_of(reply), reply.content[keys.SITE]
            node_of[site] = reply.metadata.src_node_id
            try:
                state = transport.received(reply.content).unpack()
            except transport.WireFormatError as err:  # e.g. a train reply without gamma_k
                result.refuse(node_of[site], Refusal(site, "wire", str(err)))
                unreadable.add(site)
                continue
            updates[site] = Update(
                state=state,
                num_examples=float(reply.content[keys.METRICS][keys.NUM_EXAMPLES]),
                data_size=int(info[keys.DATA_SIZE]) if keys.DATA_SIZE in info else None,
                data_changed=bool(int(info.get(keys.DATA_CHANGED, 0))),
                declared={
                    scalar.key: float(reply.content[keys.METRICS][scalar.key])
                    for scalar in self.checker.declared
                },
            )
        refusals, result.norms = self.checker.check(updates, reference)
        for site, refusal in refusals.items():
            result.refuse(node_of[site], refusal)
        result.replies = [r for r in result.replies if site_of(r) not in {*refusals, *unreadable}]
        accepted = {site: u for site, u in updates.items() if site not in refusals}
        result.states = {site: dict(u.state) for site, u in accepted.items()}
        result.weights = self.checker.weights(accepted)

    def _log_refusals(self, result: Replies, server_round: int, what: str) -> None:
        """Each refusal: a warning, a train.jsonl row and (with the audit) a wire.jsonl row."""
        for refusal in result.refused:
            log.warning("round %d %s: %s", server_round, what, refusal.line())
            if self.runlog is not None:
                self.runlog.write("train", refusal.row(server_round, what))
            if self.audit is not None:
                self.audit.write("wire", {**refusal.row(server_round, what), "direction": "up"})

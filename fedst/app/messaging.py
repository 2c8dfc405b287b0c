"""The ServerApp's side of the wire. :class:`SiteGrid` is the server's conversation with the
sites: ``ask(kind, payload, config, round)`` sends one message kind to the connected nodes and
returns the checked replies in federation order. Beneath it: :func:`broadcast` collects replies
(a failure, a silent node or parameters that cannot be unpacked is returned, not raised), polling
the SuperLink every ``deploy.reply_poll`` seconds; the wire audit (wire.jsonl); waiting for the
nodes to connect; and :func:`check_sites`, which learns which node is which site, orders the
replies by federation and stops the run (:class:`FederationError`) when fewer than
``RoundPolicy.min_sites`` answered."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedst.app import keys
from fedst.errors import UserError
from fedst.experiment import RoundPolicy
from fedst.federation import transport
from fedst.runs.files import RunLog

log = logging.getLogger("fedst.app.server_app")  # the ServerApp's log, as before the split


class FederationError(UserError, RuntimeError):
    """Too few sites answered a round (or a node claimed a site it is not): the run stops here.
    Not a bug of this process: the entry point prints the one-line reason (each failed site and
    the first line of its error; the whole errors are in the log) and exits 2; the run resumes
    from its last completed round (``train_fed.py resume=<run>``)."""


class Replies:
    """The replies of one broadcast: good replies by site, and what failed or stayed silent."""

    def __init__(self) -> None:
        self.replies: list[Message] = []
        self.failed: dict[int, str] = {}


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
    answered = set()
    replies = _send_and_receive(grid, messages, timeout, poll)
    # the SuperLink's own error replies (e.g. node unavailable) do not come from the node:
    # match each reply to its instruction
    node_of = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
    for reply in replies:
        node = node_of.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
        answered.add(node)
        if audit is not None:
            _audit(audit, "up", reply, server_round)
        if reply.has_error():
            result.failed[node] = reply.error.reason
        elif (refusal := _wire_refusal(reply)) is not None:
            result.failed[node] = refusal
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


def _wire_refusal(reply: Message) -> str | None:
    """Why the parameters of a reply cannot be unpacked (older layout, unknown manifest), or None."""
    try:
        for name in reply.content.array_records:
            transport.received(reply.content, name)
    except transport.WireFormatError as err:
        site = reply.content[keys.SITE][keys.SITE_NAME] if keys.SITE in reply.content else "?"
        return f"refused the reply of site {site}: {err}"
    return None


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
        known = set((sites_of or {}).values())
        missing = [s for s in federation if s not in known] if known else federation
        raise FederationError(
            f"{len(nodes)} of {expected} sites connected after {timeout:.0f} s (need {required}); "
            f"not connected{' (or not yet seen)' if not known else ''}: {', '.join(missing)}. "
            f"Start them with: python train_fed.py site=<name> deploy.server=<host:port>"
        )
    if len(nodes) < expected:
        log.warning("%d of %d sites connected; going on with them", len(nodes), expected)
    return nodes


def check_sites(
    result: Replies,
    sites_of: dict[int, str],
    federation: list[str],
    min_sites: int,
    kind: str,
    server_round: int,
) -> None:
    """Learn node -> site from the replies, refuse a site answering twice, and stop the run when
    fewer than ``min_sites`` sites answered."""
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
    failures = [f"{sites_of.get(n, f'node {n}')}: {reason}" for n, reason in result.failed.items()]
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
    round policy (timeouts, ``min_sites``, reply polling), the wire audit and which node is which
    site (learnt from the replies)."""

    def __init__(
        self,
        grid: Grid,
        federation: Sequence[str],
        policy: RoundPolicy,
        audit: RunLog | None = None,
    ) -> None:
        self.grid = grid
        self.federation = list(federation)
        self.policy = policy
        self.audit = audit
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
    ) -> Replies:
        """Send ``kind`` (payload in "arrays", ``config``) to ``nodes`` (default: the connected
        ones) and collect the replies within the policy's timeout (``eval_timeout`` for an
        evaluation, ``round_timeout`` otherwise). With ``check``, the replies come back in
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
        if check:
            check_sites(replies, self.sites_of, self.federation, self.min_sites, what, server_round)
        return replies

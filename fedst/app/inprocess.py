"""``engine=inprocess``: a Flower Grid that calls the ClientApp directly, in this process.

Flower's only simulation backend is Ray (about 6 s start-up and 2 GB across processes on two
cores). This Grid runs the *same* ServerApp and ClientApp synchronously: one persistent Context
per node (so ``context.state`` behaves as in simulation and deployment), every message deep-copied
on the way in and out (as the wire would), and ClientApp exceptions returned as Error replies.

It needs three Flower internals (TaskIdentity, Run, ErrorCode); flwr is pinned and
tests/test_federation.py covers this module.
"""

from __future__ import annotations

import copy
import itertools
import traceback
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

SERVER_NODE_ID = 0


class InProcessGrid(Grid):
    """Delivers each message to ``client_app(message, context_of_its_node)`` and keeps the reply.

    ``node_configs``: one ``node_config`` per virtual node (e.g. ``{"partition-id": 0, ...}``).
    ``observer``: optional callback ``(direction, message)`` with direction "down" or "up", used by
    tests to inspect every message that crosses the grid.
    """

    def __init__(
        self,
        client_app: ClientApp,
        node_configs: list[dict[str, Any]],
        run_config: dict[str, Any] | None = None,
        run_id: int = 1,
        observer: Callable[[str, Message], None] | None = None,
    ) -> None:
        self._client_app = client_app
        self._run = Run.create_empty(run_id)
        self._observer = observer
        self._replies: dict[str, Message] = {}
        self._contexts = {
            node_id: Context(
                run_id=run_id,
                node_id=node_id,
                node_config=dict(node_config),
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for node_id, node_config in zip(itertools.count(1), node_configs, strict=False)
        }
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = SERVER_NODE_ID
        TaskIdentity.task_id = 0

    # -- Grid API --------------------------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(
            content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl
        )

    def get_node_ids(self) -> Iterable[int]:
        return list(self._contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            message_id = uuid.uuid4().hex
            message.metadata.__dict__["_message_id"] = message_id
            if self._observer is not None:
                self._observer("down", message)
            delivered = copy.deepcopy(message)
            context = self._contexts[delivered.metadata.dst_node_id]
            try:
                reply = self._client_app(delivered, context)
            except Exception as err:  # the ClientApp's failure becomes an Error reply, as in Flower
                reason = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=3)}"
                reply = Message(
                    Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason),
                    reply_to=delivered,
                )
            reply = copy.deepcopy(reply)
            reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            if self._observer is not None:
                self._observer("up", reply)
            self._replies[message_id] = reply
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))

    def context_of(self, node_id: int) -> Context:
        """The persistent Context of a node (tests inspect ``state`` through it)."""
        return self._contexts[node_id]

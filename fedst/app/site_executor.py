"""A site's long-lived ClientApp executor: one Python process that runs every message of its
SuperNode, so imports and the live :class:`fedst.federation.site.Site` objects persist across
rounds.

    python -m fedst.app.site_executor --runtime-api-address 127.0.0.1:<site port>

Why this exists. With its default ``--isolation subprocess``, Flower 1.41's SuperNode starts
``flower-superexec``, which launches one ``flwr-clientapp`` process per message
(flwr/supercore/superexec/executor/subprocess_executor.py, ``SubprocessExecutor.launch``), and
``flwr-clientapp`` runs exactly one task: it needs that task's ``--token``
(flwr/common/args.py, ``add_args_flwr_app_common``) and ends with ``flwr_exit``
(flwr/supernode/runtime/run_clientapp.py, ``run_clientapp``). Flower's warm executors are for
Kubernetes and for other task types only (flwr/supercore/superexec/executor/warm_executor_pool.py,
``WARM_EXECUTOR_TASK_TYPES``). So every round would re-import torch and rebuild each site's model
and data. A SuperNode started with ``--isolation process`` starts no executor and waits for an
external one; this module is that executor: it acquires tasks from the SuperNode's Runtime API
like ``flower-superexec`` does and runs each one in this process with the same protocol as
``run_clientapp`` (pull the message and context, call the ClientApp, push the reply and the task
output), using Flower's own functions for every step.

The ClientApp is this installation's ``fedst.app.client_app:app`` (dependencies and code are
pre-installed at each site, docs/deployment.md); the run's FAB is not re-installed per message.
State on disk stays authoritative: a restarted executor rebuilds each site from its state folder.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from fedst.errors import ArgumentParser

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1
"""Pause between two task requests when the SuperNode has nothing to run (``deploy.executor_poll``
passes the configured value)."""


def run_task(runtime_api_address: str, token: str, app: Any) -> bool:
    """Run one ClientApp task (the body of flwr's ``run_clientapp`` without the process exit).
    Returns whether the ClientApp completed."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

    retry_invoker = make_simple_http_retry_invoker()
    client = RuntimeHttpClient.from_server_address(
        server_address=runtime_api_address,
        insecure=True,
        root_certificates=None,
        interceptors=[
            RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
            RuntimeTokenHttpInterceptor(token),
        ],
        retry_invoker=retry_invoker,
    )
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    message = reply = context = None
    status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
    try:
        heartbeat.start()
        started = time.perf_counter()
        message, context = pull_task_input(client)
        pulled = time.perf_counter()
        reply = app(message=message, context=context)
        status, details = SubStatus.COMPLETED, ""
        log.info(
            "%s message: pulled from the SuperNode in %.1f s, handled in %.1f s",
            message.metadata.message_type,
            pulled - started,
            time.perf_counter() - pulled,
        )
    except Exception as err:  # reported to the server as the reply, like run_clientapp does
        log.exception("the ClientApp raised an exception")
        details = f"{type(err)}:<'{err}'>"
        if message is not None:
            reply = Message(
                Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details),
                reply_to=message,
            )
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
        except Exception:
            log.exception("failed to push the reply to the SuperNode")
            status = SubStatus.FAILED
        retry_invoker.max_tries = 1
        push_task_output(client=client, context=context, sub_status=status, details=details)
        if heartbeat.is_running:
            heartbeat.stop()
        client.close()
    return status == SubStatus.COMPLETED


def pull_task_input(client: Any) -> tuple[Any, Any]:
    """The task's message and context: flwr's ``run_clientapp.pull_task_input`` with a short
    retry pause. The SuperNode creates the task before it has fetched the message's objects from
    the SuperLink; Flower's default pause between two tries of an object starts at 1 s and doubles
    up to 10 s (``PULL_INITIAL_BACKOFF``, ``PULL_BACKOFF_CAP`` in flwr/supercore/constant.py), so
    the ClientApp would sleep for seconds after the objects have arrived. The Runtime API is on
    this machine, so polling it every 0.05-0.5 s costs nothing."""
    from flwr.app import Message
    from flwr.common.serde import context_from_proto
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    task = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = task.task_id
    TaskIdentity.run_id = task.run.run_id
    TaskIdentity.node_id = task.context.node_id
    context = context_from_proto(task.context)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree,
        make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(
            client.ConfirmMessageReceived, node, context.run_id
        ),
        return_type=Message,
        initial_backoff=0.05,
        backoff_cap=0.5,
    )
    message.metadata.__dict__["_message_id"] = tree.object_id  # as flwr's pull_task_input
    return message, context


def serve(runtime_api_address: str, poll_seconds: float = POLL_SECONDS) -> None:
    """Acquire ClientApp tasks from the SuperNode at ``runtime_api_address`` and run them here,
    one after another, until terminated."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    from fedst.app.client_app import app  # imported once for every round

    client = RuntimeHttpClient.from_server_address(
        server_address=runtime_api_address,
        insecure=True,
        root_certificates=None,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec")],
        retry_invoker=make_simple_http_retry_invoker(),
    )
    log.info("ClientApp executor (pid %d) serving %s", os.getpid(), runtime_api_address)
    try:
        while True:
            task = client.AcquireTask(
                AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
            )
            if task.HasField("task") and task.token:
                started = time.perf_counter()
                done = run_task(runtime_api_address, task.token, app)
                log.info(
                    "task %d %s in %.1f s",
                    task.task.task_id,
                    "done" if done else "failed",
                    time.perf_counter() - started,
                )
            else:
                time.sleep(poll_seconds)
    finally:
        client.close()


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m fedst.app.site_executor", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--runtime-api-address", required=True, help="the SuperNode's host:port")
    parser.add_argument(
        "--poll-seconds",
        type=float,
        default=POLL_SECONDS,
        help="pause between two task requests when idle (deploy.executor_poll)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per object and poll

    def leave(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)
    exit_with_parent()
    serve(args.runtime_api_address, args.poll_seconds)


def exit_with_parent() -> None:
    """End this process when the process that started it is gone (even if it was killed
    with SIGKILL and could not stop its children): the site process for this executor, the
    SuperExec for the deployed ServerApp (fedst.deploy.server_app.run_config_to_run)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    from fedst.errors import run_entry_point

    run_entry_point(main, "python -m fedst.app.site_executor")

"""A site keeps its Ray actor (``ray.site_affinity``): each message goes to the actor that ran
its site last, when that actor is idle.

Flower 1.41's Ray backend takes the last idle actor of a list for each message
(flwr/simulation/ray_transport/ray_actor.py, ``BasicActorPool.submit``: ``self.pool.pop()``),
whichever site the message is for, so across rounds a site wanders between actors and each
actor that gets it restores it from disk and restarts its loader workers (bench/site_rebuild.py:
the restart is most of the cost). :func:`site_affinity` replaces the pool class the backend
builds (``flwr.server.superlink.fleet.vce.backend.raybackend.BasicActorPool``) by a subclass
whose ``submit`` asks :class:`SiteAffinity` which idle actor to use; the rest of Flower's pool
is unchanged. Flower runs the backend in this (the driver's) process, so the replacement holds
for the whole simulation. With as many actors as sites (the default shares of
fedst.training.ray_client_resources) every site has its own actor from round 2 on: the server
sends a round's messages once every actor is idle again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

log = logging.getLogger(__name__)

RAY_BACKEND_MODULE = "flwr.server.superlink.fleet.vce.backend.raybackend"
"""Where Flower's Ray backend looks up ``BasicActorPool`` when it builds its pool."""


class SiteAffinity:
    """Which actor ran each site (Flower's partition id, ``cid``) last, and which idle actor a
    site's next message should take: its own if idle, else one no other site has, else the one
    Flower would have taken (the last idle one)."""

    def __init__(self) -> None:
        self.owner: dict[str, Hashable] = {}
        """cid -> the actor that ran it last."""

    def pick(self, cid: str, idle: Sequence[Hashable]) -> int:
        """Index in ``idle`` (not empty) of the actor for ``cid``'s next message."""
        if not idle:
            raise ValueError(f"SiteAffinity.pick: no idle actor for site {cid}")
        own = self.owner.get(cid)
        if own is not None and own in idle:
            return idle.index(own)
        taken = {actor for site, actor in self.owner.items() if site != cid}
        free = [i for i, actor in enumerate(idle) if actor not in taken]
        return free[-1] if free else len(idle) - 1

    def ran(self, cid: str, actor: Hashable) -> None:
        """``actor`` runs ``cid`` now."""
        previous = self.owner.get(cid)
        if previous is not None and previous is not actor:
            log.info("Ray: site %s moves to another actor (its own is busy)", cid)
        self.owner[cid] = actor


def sticky_pool_class(base: type) -> type:
    """A subclass of Flower's ``BasicActorPool`` (``base``) whose ``submit`` takes the actor
    :class:`SiteAffinity` picks for the message's site instead of the last idle one."""
    if not callable(getattr(base, "submit", None)):
        raise RuntimeError(
            f"{base.__module__}.{base.__name__} has no submit(): this Flower version's Ray pool "
            f"differs from 1.41's; set ray.site_affinity=false"
        )

    class StickyActorPool(base):  # type: ignore[misc, valid-type]
        """Flower's BasicActorPool; each message goes to the actor that ran its site last."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.affinity = SiteAffinity()
            self._pick_lock = threading.Lock()  # Flower submits from one thread per actor

        def submit(self, actor_fn: Any, job: tuple[Any, Any, str, Any]) -> Any:
            app_fn, message, cid, context = job
            with self._pick_lock:
                actor = self.pool.pop(self.affinity.pick(cid, self.pool))
                self.affinity.ran(cid, actor)
            future = actor_fn(actor, app_fn, message, cid, context)
            self._future_to_actor[future] = actor
            return future

    return StickyActorPool


@contextlib.contextmanager
def site_affinity(enabled: bool = True) -> Iterator[None]:
    """While open, Flower's Ray backend builds a :func:`sticky_pool_class` pool (nothing when
    ``enabled`` is False, or without Ray, where Flower's run_simulation cannot start anyway)."""
    if not enabled:
        yield
        return
    import importlib

    try:
        backend = importlib.import_module(RAY_BACKEND_MODULE)  # imports ray
    except ModuleNotFoundError as err:  # no Ray: no Ray pool to change (run_simulation says so)
        if err.name != "ray":
            raise
        yield
        return
    original = getattr(backend, "BasicActorPool", None)
    if original is None:
        raise RuntimeError(
            f"{RAY_BACKEND_MODULE} has no BasicActorPool: this Flower version's Ray backend "
            f"differs from 1.41's; set ray.site_affinity=false"
        )
    backend.BasicActorPool = sticky_pool_class(original)
    try:
        yield
    finally:
        backend.BasicActorPool = original

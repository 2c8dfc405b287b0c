"""A site keeps its Ray actor (issue 33, item 5; fedst/app/ray_affinity.py).

Flower's own Ray backend and actor pool (flwr/server/superlink/fleet/vce/backend/raybackend.py,
flwr/simulation/ray_transport/ray_actor.py) run against a synchronous stand-in for the few ``ray``
calls they make, so this fast test exercises Flower's real ``process_message`` path with the pool
fedst installs; tests/test_ray_engine.py (slow) runs real Ray and counts each site's actor."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from fedst.app.ray_affinity import RAY_BACKEND_MODULE, SiteAffinity, site_affinity

FLOWER_RAY_MODULES = (RAY_BACKEND_MODULE, "flwr.simulation.ray_transport.ray_actor")


def test_a_site_takes_its_own_idle_actor_else_one_no_other_site_has():
    affinity = SiteAffinity()
    assert affinity.pick("0", ["a", "b", "c"]) == 2  # new site, nothing taken: Flower's choice
    affinity.ran("0", "c")
    assert affinity.pick("1", ["a", "b", "c"]) == 1  # c is site 0's
    affinity.ran("1", "b")
    assert affinity.pick("0", ["c", "a", "b"]) == 0  # its own, wherever it is in the list
    assert affinity.pick("0", ["a", "b"]) == 0  # its own is busy: a, which no site has
    assert affinity.pick("2", ["b", "c"]) == 1  # every idle actor is some site's: the last
    with pytest.raises(ValueError, match="no idle actor for site 3"):
        affinity.pick("3", [])


def fake_ray(cpus: int) -> dict[str, types.ModuleType]:
    """The ``ray`` calls Flower's backend makes, run synchronously in this process."""
    ray = types.ModuleType("ray")

    class Future:
        def __init__(self, value):
            self.value = value

    class Handle:
        def __init__(self, actor):
            self.actor = actor
            self.run = SimpleNamespace(remote=lambda *args: Future(actor.run(*args)))
            self.terminate = SimpleNamespace(remote=lambda: None)

    def remote(cls):
        factory = SimpleNamespace(remote=lambda **kwargs: Handle(cls(**kwargs)))
        return SimpleNamespace(options=lambda **resources: factory)

    ray.remote = remote
    ray.get = lambda future: future.value
    ray.nodes = lambda: [{"Resources": {"CPU": cpus, "GPU": 0}}]
    ray.is_initialized = lambda: True
    ray.shutdown = lambda: None
    ray.ObjectRef = Future
    ray.exceptions = SimpleNamespace(RayActorError=RuntimeError)
    util = types.ModuleType("ray.util")
    actor_pool = types.ModuleType("ray.util.actor_pool")
    actor_pool.ActorPool = type("ActorPool", (), {})
    util.actor_pool = actor_pool
    ray.util = util
    return {"ray": ray, "ray.util": util, "ray.util.actor_pool": actor_pool}


@pytest.fixture
def ray_backend(monkeypatch):
    """Flower's RayBackend module imported against the stand-in (removed again afterwards)."""
    for name, module in fake_ray(cpus=4).items():
        monkeypatch.setitem(sys.modules, name, module)
    for name in FLOWER_RAY_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    import importlib

    yield importlib.import_module(RAY_BACKEND_MODULE)
    for name in FLOWER_RAY_MODULES:
        sys.modules.pop(name, None)


def actors_per_site(ray_backend, monkeypatch, affinity: bool, rounds: int = 3):
    """Per round, site (partition id) -> the actor that ran its message (the actor object's
    id, seen in Flower's ClientAppActor.run), 4 sites messaged in turn on Flower's pool of 4
    actors (4 CPUs, 1 CPU per site)."""
    module = sys.modules["flwr.simulation.ray_transport.ray_actor"]
    actor_run = module.VirtualClientEngineActor.run
    seen: list[tuple[int, int]] = []

    def run(self, client_app_fn, message, cid, context):
        seen.append((int(cid), id(self)))
        return actor_run(self, client_app_fn, message, cid, context)

    monkeypatch.setattr(module.VirtualClientEngineActor, "run", run)
    with site_affinity(affinity):
        backend = ray_backend.RayBackend({"client_resources": {"num_cpus": 1, "num_gpus": 0}})
        backend.build(lambda: lambda message, context: message)
    assert backend.num_workers == 4
    for _ in range(rounds):
        for site in range(4):
            context = SimpleNamespace(node_config={"partition-id": site})
            backend.process_message(SimpleNamespace(), context)
    return [dict(seen[4 * r : 4 * r + 4]) for r in range(rounds)]


def test_with_site_affinity_each_site_keeps_one_actor_of_its_own(ray_backend, monkeypatch):
    rounds = actors_per_site(ray_backend, monkeypatch, affinity=True)
    assert len(set(rounds[0].values())) == 4  # four sites, four actors
    assert rounds[0] == rounds[1] == rounds[2]  # each keeps its own
    assert ray_backend.BasicActorPool.__name__ == "BasicActorPool"  # Flower's, again on exit


def test_without_it_flowers_pool_runs_sites_on_whichever_actor_is_last_idle(
    ray_backend, monkeypatch
):
    rounds = actors_per_site(ray_backend, monkeypatch, affinity=False)
    # messages one after another: the same (last idle) actor every time, whatever the site
    assert {actor for per_round in rounds for actor in per_round.values()} == {rounds[0][0]}

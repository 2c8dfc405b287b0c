"""How a process keeps the sites it runs (issue 33, item 5): Flower's Ray engine hands each
message to whichever actor is idle, so an actor keeps at most ``ray.sites_per_actor`` built sites
(least recently used released), only the site it runs keeps loader workers, and a site that
comes back to an actor holding it is reused, not rebuilt. Ray is not needed: the ClientApp that
Ray's actors run (fedst.app.client_app.make_client_app) is called here directly, as an actor
would call it, with the real Site objects of the tiny preset."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from fedst.app import client_app
from fedst.app.nodes import site_node_config
from fedst.config import ConfigError, build
from fedst.data.procedural import generate
from fedst.experiment import RayConfig, site_view
from tests.test_federation import experiment


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


@pytest.fixture
def sites(tiny_root, tmp_path, monkeypatch):
    """``message_for(site)``: what an actor's ClientApp receives for ``site``, and the Site
    constructions seen (site names, in order)."""
    cfg = experiment(tiny_root, "data.federation=[A,B,C]", "data.out_of_federation=[]")
    names = list(cfg.data.federation)
    nodes = {
        name: site_node_config(cfg, name, state_dir=str(tmp_path / "state" / name)).to_node_config()
        for name in names
    }
    config = {"experiment": site_view(cfg).to_json(), "run-name": "run"}
    built: list[str] = []
    real = client_app.Site

    def counting(name, *args, **kwargs):
        built.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(client_app, "Site", counting)

    def message_for(name: str):
        message = SimpleNamespace(content={"config": config})
        return message, SimpleNamespace(node_config=nodes[name])

    yield message_for, built
    client_app.keep_live_sites(None)
    client_app.release_sites()


def live() -> list[str]:
    return [site.name for site in client_app._SITES.values()]


def test_an_actor_reuses_the_sites_it_holds_and_releases_the_least_recently_used(sites):
    message_for, built = sites
    client_app.keep_live_sites(2)
    for name in ["A", "B", "A", "C", "A", "B"]:  # as Ray's idle actors might get them
        client_app._site_for(*message_for(name))
    # A built once (it stayed among the 2 most recent); B released when C came, so built again
    assert built == ["A", "B", "C", "B"]
    assert live() == ["A", "B"]  # least recently used first
    client_app.keep_live_sites(1)  # a lower bound releases at once
    assert live() == ["B"]


def watch_closes(site, closed: list[str]) -> None:
    """Record in ``closed`` each time ``site``'s loader workers are stopped."""
    stop = site.stream.close

    def recording() -> None:
        closed.append(site.name)
        stop()

    site.stream.close = recording


def test_without_a_limit_a_process_keeps_every_site_and_its_loaders(sites):
    message_for, built = sites
    client_app.keep_live_sites(None)  # the in-process engine: every site in this process
    closed: list[str] = []
    watched: set[str] = set()
    for name in ["A", "B", "C", "A", "B", "C"]:
        site, _ = client_app._site_for(*message_for(name))
        if name not in watched:
            watch_closes(site, closed)
            watched.add(name)
    assert built == ["A", "B", "C"] and sorted(live()) == ["A", "B", "C"]
    assert closed == []  # no site's workers stopped


def test_in_a_ray_actor_only_the_running_site_keeps_its_loader_workers(sites):
    message_for, _ = sites
    client_app.keep_live_sites(None, pause_idle_loaders=True)  # a Ray actor, "all"
    closed: list[str] = []
    for name in ["A", "B", "C"]:
        site, _ = client_app._site_for(*message_for(name))
        watch_closes(site, closed)
    assert closed == ["A", "A", "B"]  # B came: A stopped; C came: A and B stopped
    assert sorted(live()) == ["A", "B", "C"]  # all still built


def test_the_ray_client_app_applies_ray_sites_per_actor_in_the_actor(monkeypatch):
    calls = []
    monkeypatch.setattr(client_app, "keep_live_sites", lambda *args, **kw: calls.append((args, kw)))
    app = client_app.make_client_app([{}], sites_per_actor=build(RayConfig, {}, "ray").site_limit)
    assert calls == []  # not in the driver: in the process that runs the message
    handler = app._registered_funcs["train.default"]  # what Flower calls for a train message
    with pytest.raises(KeyError):  # the fake message has no arrays; the limit came first
        handler(SimpleNamespace(content={}), SimpleNamespace(node_config={"partition-id": 0}))
    assert calls == [((None,), {"pause_idle_loaders": True})]  # "all" by default
    assert build(RayConfig, {"sites_per_actor": 1}, "ray").site_limit == 1


def test_ray_sites_per_actor_takes_a_count_or_all():
    assert RayConfig().sites_per_actor == "all"
    with pytest.raises(ConfigError, match=r'ray\.sites_per_actor=0: must be >= 1; or "all"'):
        RayConfig(sites_per_actor=0)
    with pytest.raises(ConfigError, match=r"ray\.sites_per_actor='some'"):
        build(RayConfig, {"sites_per_actor": "some"}, "ray")
    with pytest.raises(ValueError, match="limit=0"):
        client_app.keep_live_sites(0)

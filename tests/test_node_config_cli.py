"""A site's node config survives the trip through ``flower-supernode --node-config``: what
``SiteNodeConfig.to_cli`` writes, Flower's own parser reads back as the same values."""

from flwr.common.config import parse_config_args

from fedst.experiment import SiteNodeConfig


def test_backend_options_in_json_reach_the_supernode_unchanged():
    node = SiteNodeConfig(
        site_name="S05",
        data_path="/data/sites with space/A",
        site_options='{"site_dir": "A", "label_every": 2}',
        other_sites='{"A": {"path": "/x", "options": "{}"}}',
        state_dir="/state",
        progress=True,
        num_workers=2,
    )

    parsed = parse_config_args([node.to_cli()])

    assert parsed == node.to_node_config()


def test_the_default_empty_options_reach_the_supernode_unchanged():
    node = SiteNodeConfig(site_name="A", data_path="/data/A")

    assert parse_config_args([node.to_cli()]) == node.to_node_config()

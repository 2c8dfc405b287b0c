"""Importing FedST asks no network: hospital machines often have no route out (and must not call
out unasked); on the GPU machine every process printed albumentations' failed lookup."""

import os
import subprocess
import sys

PROBE = """
import urllib.request
calls = []
def refuse(self, *args, **kwargs):
    calls.append(args[0] if args else kwargs.get("fullurl"))
    raise OSError("no network in this test")
urllib.request.OpenerDirector.open = refuse
import fedst.data.clips  # imports albumentations
print(len(calls))
"""


def _network_calls_of_import(environment: dict[str, str]) -> int:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=environment, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return int(result.stdout.strip().splitlines()[-1])


def test_importing_fedst_makes_no_network_request_unless_the_user_asks_for_the_update_check():
    environment = {k: v for k, v in os.environ.items() if k != "NO_ALBUMENTATIONS_UPDATE"}
    assert _network_calls_of_import(environment) == 0
    # a user who wants albumentations' version check keeps it (the variable is only defaulted)
    assert _network_calls_of_import({**environment, "NO_ALBUMENTATIONS_UPDATE": "0"}) >= 1

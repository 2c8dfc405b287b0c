"""FedST: personalized federated segmentation of surgical instruments in video.

Layer: the root; its modules (config, errors, storage, units, seeding, accel, progress) import
nothing of fedst but one another.
"""

import os
from pathlib import Path

# albumentations asks PyPI for its newest version at import unless this is set: from a hospital
# machine that is outbound traffic nobody asked for, and where the network is closed each import
# (and each fresh process: a loader's fork server, a deployed site) waits for the request to fail
# (on the GPU machine every process printed the failed lookup). A user who wants the check sets
# it to 0.
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")


def user_cache_dir() -> Path:
    """FedST's cache folder of this user: ``$FEDST_CACHE_DIR``, else ``$XDG_CACHE_HOME/fedst``,
    else ``~/.cache/fedst`` (data validation, torch's compile cache)."""
    if os.environ.get("FEDST_CACHE_DIR"):
        return Path(os.environ["FEDST_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedst"


# torch (2.14) makes its compile cache folder when it is imported (torch._dynamo.package), by
# default ``<temp folder>/torchinductor_<user>``, and every run left it there. Set before any
# module of fedst imports torch: the user's cache folder instead, unless the user chose one.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(user_cache_dir() / "torchinductor"))

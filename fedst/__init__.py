"""FedST: personalized federated segmentation of surgical instruments in video.

Layer: the root; its modules (config, errors, storage, units, seeding, accel, progress) import
nothing of fedst but one another.
"""

import os

# albumentations asks PyPI for its newest version at import unless this is set: from a hospital
# machine that is outbound traffic nobody asked for, and where the network is closed each import
# (and each fresh process: a loader's fork server, a deployed site) waits for the request to fail
# (on the GPU machine every process printed the failed lookup). A user who wants the check sets
# it to 0.
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

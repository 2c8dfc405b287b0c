"""The names and config dataclasses that the lower packages' configs are made of, without torch,
timm, torchvision, albumentations or flwr, so that reading and checking a config (Hydra's
composition, fedst.experiment, the did-you-mean errors, ``--help``) imports none of them:

* ``accel``: ``train.amp_dtype`` and ``train.compile`` values (fedst/accel/ applies them);
* ``clips``: :class:`ClipConfig` and :class:`AugmentConfig` (fedst/data/clips/ reads them);
* ``feature_bank``: the places of SERQ's feature bank in a run directory (fedst.runs.layout
  names them with the other run files);
* ``data``: the procedural generator's versions, validation sources and partitions
  (fedst.data.sites.DataConfig checks against them);
* ``network``: :class:`NetworkConfig` (fedst/model/network.py builds it);
* ``indicators``: the indicator kinds, CLIP's text tower and ``indicator.unseen``;
* ``labels``: the unified label encoding (class names, ignore index) of fedst/data/base.py;
* ``partition``: the personalization presets and network components (fedst/model/partition.py).

Each is imported from its module (``fedst.schema.network``); the packages above re-export
what they always offered (``fedst.model.network.NetworkConfig``).

Layer: the root; imports fedst.config only.
"""

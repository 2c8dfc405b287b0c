"""Which sites exist and where their data lives: the typed form of configs/data/*.yaml.

```yaml
federation: [A, B, C, D]        # sites that train together
out_of_federation: [E, grasp]   # evaluated only (eval_outfed.py)
server: synthetic               # the server's synthetic set for SERQ (null: none)
sites:
  A: {backend: endovis2017, root: data/endovis2017, surgery_type: nephrectomy, options: {}}
```
``options`` are passed to the backend class as keyword arguments (see fedst/data/registry.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedst.config import ConfigError
from fedst.schema.data import GENERATOR_VERSION, GENERATOR_VERSIONS, PARTITIONS, VAL_SPLIT_SOURCES
from fedst.schema.roles import EXECUTION, role

if TYPE_CHECKING:
    from fedst.data.base import SiteSource


@dataclass(frozen=True)
class SiteSpec:
    backend: str
    """Backend name, one of fedst.data.registry.BACKENDS."""
    root: str
    """Dataset root folder (relative paths are relative to the working directory)."""
    surgery_type: str
    """Surgery type, used in the site's text prompt (paper Eq. 7)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Backend-specific keyword options."""


@dataclass(frozen=True)
class DataConfig:
    sites: dict[str, SiteSpec]
    """Every site the experiment may touch, by name."""
    federation: tuple[str, ...] = ("A", "B", "C", "D")
    """Sites that train together (paper: A-D)."""
    out_of_federation: tuple[str, ...] = ("E", "grasp")
    """Sites used only for out-of-federation evaluation (paper: E; Table VIII: GraSP)."""
    server: str | None = "synthetic"
    """The server's synthetic dataset for SERQ, or None."""
    mix_synthetic: bool = False
    """Mix the server's synthetic set into every training party's training split (paper
    Sec. IV-C5 green line, IV-C6 / Fig. 7: "all synthetic samples are fully mixed into the real
    training data for each site"); each site reads the set from its own disk, as the server does,
    and is still tested on its own test split only (fedst/scoring/site_data.py). Needs
    ``server``. False: no synthetic data at the sites (the paper's default)."""
    root: str | None = None
    """Optional common dataset root that site entries may refer to as ${data.root}."""
    procedural: str | None = None
    """Preset of the embedded procedural benchmark held in ``root`` (tiny | demo | full); training
    generates it there when missing. None for real data, which is never generated."""
    generator_version: int = GENERATOR_VERSION
    """Rendering version of the procedural benchmark (fedst/data/procedural/
    GENERATOR_VERSIONS, with their changelog); an older one stays reproducible under its own data
    config (configs/data/demo_v1.yaml). A run saved before this key existed was on version 1."""
    val_split: str = "dataset"
    """Where the training sites' validation videos come from (model selection, fedst/runs/model_selection.py):
    dataset (the dataset's own val split) | train (``val_videos`` whole training videos, seeded by
    ``val_seed``, leave training). Rule and per-backend availability: fedst/data/splits.py."""
    val_videos: int = 1
    """Whole training videos per site moved to validation when ``val_split`` is train."""
    val_seed: int = 0
    """Seed of which training videos ``val_split=train`` moves (fixed across run seeds)."""
    partition: str = "natural"
    """natural (each site its own data, the paper) | iid (heterogeneity control, simulation only:
    every split's videos of all federated sites pooled and dealt out again, each site getting as
    many whole videos as it had, linked into ``<site root>/iid_s<seed>/<site>`` before training;
    fedst/data/splits.py materialize_iid)."""
    partition_seed: int = 0
    """Seed of the iid re-partition."""
    cache_dir: str | None = field(default=None, metadata=role(EXECUTION))
    """Read every site's clip frames and labels from the preprocessed cache in this folder,
    already resized to ``clip.image_size`` (uint8, memory-mapped; fedst/data/clips/cache.py),
    instead of decoding and resizing them in the loaders: built once by ``python -m
    fedst.preprocess build <the run's overrides> data.cache_dir=<folder>``. A missing or stale
    cache stops the run naming the file (never a fallback to decoding). None: decode (default).
    Role execution: the pixels are the same either way, so it stays out of a site's state
    fingerprint; like a path, it is not sent to the sites (each has its own, node config
    ``frame-cache``)."""

    def __post_init__(self) -> None:
        if not self.federation:
            raise ConfigError(
                f"data.federation={list(self.federation)}: list at least one site of "
                f"{sorted(self.sites)}"
            )
        for key in ("federation", "out_of_federation"):
            names = getattr(self, key)
            repeated = sorted({s for s in names if names.count(s) > 1})
            if repeated:
                raise ConfigError(
                    f"data.{key}={list(names)}: site(s) {repeated} listed more than once; "
                    "list each site once"
                )
        if self.mix_synthetic and self.server is None:
            raise ConfigError(
                "data.mix_synthetic=true mixes the server's synthetic set into every site's "
                "training data, but data.server is null: set data.server to the synthetic set "
                "(e.g. synthetic), or data.mix_synthetic=false"
            )
        named = [*self.federation, *self.out_of_federation, *([self.server] if self.server else [])]
        missing = [s for s in named if s not in self.sites]
        if missing:
            raise ConfigError(f"data config names site(s) {missing} without an entry under 'sites'")
        if self.val_split not in VAL_SPLIT_SOURCES:
            raise ConfigError(
                f"data.val_split={self.val_split!r}; choose one of {VAL_SPLIT_SOURCES}"
            )
        if self.partition not in PARTITIONS:
            raise ConfigError(f"data.partition={self.partition!r}; choose one of {PARTITIONS}")
        if self.val_videos < 1:
            raise ConfigError(f"data.val_videos={self.val_videos}: must be >= 1")
        if self.generator_version not in GENERATOR_VERSIONS:
            raise ConfigError(
                f"data.generator_version={self.generator_version!r}; choose one of "
                f"{sorted(GENERATOR_VERSIONS)} (changelog: fedst/data/procedural/__init__.py)"
            )
        if self.procedural is not None and not self.root:
            raise ConfigError(
                "data.procedural is set but data.root is not: say where to generate it"
            )

    def open(self, name: str) -> SiteSource:
        """The SiteSource of site ``name``; a site that trains or selects (neither the server's set
        nor out of federation) with its validation split of ``val_split`` (fedst/data/splits.py),
        its clips read from the frame cache when ``cache_dir`` is set."""
        if self.cache_dir is not None:
            from fedst.data.clips.cache import CachedSource

            return CachedSource(self.open_decoded(name), self.cache_dir)
        return self.open_decoded(name)

    def open_decoded(self, name: str) -> SiteSource:
        """:meth:`open` without the frame cache: what the cache is built from."""
        from fedst.data.registry import open_site  # the backends (torch): not to read a config
        from fedst.data.splits import iid_site_root, with_validation_split

        spec = self.sites[name]
        source = open_site(spec.backend, Path(spec.root), name, **spec.options)
        if name == self.server or name in self.out_of_federation:
            return source
        if self.partition == "iid" and name in self.federation:
            iid_root = iid_site_root(spec.root, self.partition_seed)
            if not (iid_root / name).is_dir():
                raise ConfigError(
                    f"data.partition=iid: {iid_root / name} is missing; the iid control is built "
                    f"from every federated site's data before training (simulation: train_fed.py "
                    f"builds it), so it cannot start at a deployed site"
                )
            source = open_site("generic", iid_root, name)
        return with_validation_split(source, self.val_split, self.val_videos, self.val_seed)

    def build_iid(self) -> dict[str, dict[str, list[str]]] | None:
        """Write the iid control's sites (data.partition=iid; fedst/data/splits.py
        materialize_iid) from every federated site's own data; None when the partition is natural."""
        from fedst.data.registry import open_site  # the backends (torch): not to read a config
        from fedst.data.splits import materialize_iid

        if self.partition != "iid":
            return None
        sources = {}
        for site in self.federation:
            spec = self.sites[site]
            sources[site] = open_site(spec.backend, Path(spec.root), site, **spec.options)
        roots = {site: self.sites[site].root for site in self.federation}
        return materialize_iid(sources, roots, self.partition_seed)

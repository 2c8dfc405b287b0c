"""What a data config may name, without torch or the dataset backends: the procedural
generator's versions (``data.generator_version``; rendered by fedst/data/procedural/), where
validation videos come from (``data.val_split``) and how the federation is partitioned
(``data.partition``; both applied by fedst/data/splits.py). :class:`fedst.data.sites.DataConfig`
checks its values against them."""

from __future__ import annotations

GENERATOR_VERSION = 2
"""The rendering written by default; :data:`GENERATOR_VERSIONS` lists every version still rendered."""
GENERATOR_VERSIONS: dict[int, str] = {
    1: "sites differ in tissue family and camera; every A-D tissue is a saturated red / pink / "
    "purple, so a grey or pale region is always metal (the shortcut that kept site E at the floor)",
    2: "version 1 plus surgical clutter in every non-cartoon site (:data:`CLUTTER`): per-video "
    "tissue saturation and brightness (patients, irrigation), pale fascia sheets and dark cautery "
    "marks; version 1's random streams and bytes are unchanged (tests/test_generator_versions.py)",
    3: "version 2 plus temporal phenomena in every video site (:data:`PHENOMENA`): instrument "
    "speed from published tool-tip speeds and a laparoscope's field of view, motion blur, "
    "surgical smoke after cautery, specular flashes and instruments hidden under tissue folds; "
    "version 2's random streams and bytes are unchanged (tests/test_generator_v3.py)",
    4: "version 3's images and masks, with motion blur counted as degrading only the pixels it "
    "changes (:data:`~fedst.data.procedural.phenomena.BLUR_CHANGES`) and preset demo_outfed30's "
    "30-video out-of-federation test splits; version 3's bytes are unchanged "
    "(tests/test_generator_v4.py)",
}
VAL_SPLIT_SOURCES = ("dataset", "train")
"""``data.val_split``: the dataset's own val split | whole training videos (fedst/data/splits.py)."""
PARTITIONS = ("natural", "iid")
"""``data.partition``: natural (each site its own data) | iid (the pooled-then-resplit control)."""

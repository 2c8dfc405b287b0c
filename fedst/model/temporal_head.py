"""The temporal module in the decode head, as CFFM places it (``network.temporal_placement``
= "decode_head"; docs/design-notes.md, "The temporal module against CFFM", row 10).

CFFM (``GuoleiSun/VSS-CFFM``, ``mmseg/models/decode_heads/cffm_head.py``,
``CFFMHead_clips_resize1_8.forward``): every clip frame is decoded to the fused four-stage map
``_c`` (stride 4, ``embed_dim`` 256 in its B0 config); ``linear_pred(_c)`` is each frame's own
prediction; ``_c`` is resized to half its size (``int(h / 2)``, bilinear) and the T frames' maps
go through the cross-frame block (``decoder_focal``, 8 heads of 32 channels); ``linear_pred2``
reads ``concat(_c_further[:, -1], _c2[:, -1])``, the current frame's half-size map before and
after the block (2 x dim channels), and its logits are resized back to the fused map's size.

Here ``_c`` is the map FedST's decoder head reads (:meth:`fedst.model.decoder.FPNDecoder.fused_map`:
fused at stride 4 *and* refined by the decoder's transformer block), so that ``linear_pred`` is
the decoder's own head and the decoder's block (Table V's ``decoder Attn.q``) stays on the path
of the temporal prediction. CFFM's dropout (0.1) before both classifiers is not reproduced (the
FPN decoder has none). :class:`TemporalDecodeHead` holds the block and ``linear_pred2``; both sit
under ``temporal.decode_head.*`` (the temporal module's lr multiplier and partition rules).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedst.model.temporal_cffm import CFFMTemporalBlock

__all__ = ["DECODE_HEAD", "TemporalDecodeHead", "decode_head_map_size"]

DECODE_HEAD = "decode_head"
"""Key of the decode-head temporal module in ``FedSTNet.temporal`` and of its cached maps in a
streaming history."""


def decode_head_map_size(fused_size: tuple[int, int]) -> tuple[int, int]:
    """[h, w] of the fused stride-4 map -> the block's map size, CFFM's ``(int(h/2), int(w/2))``."""
    return fused_size[0] // 2, fused_size[1] // 2


class TemporalDecodeHead(nn.Module):
    """CFFM's cross-frame block and temporal classifier on the decoder's fused maps.

    ``forward(fused [B, T, D, h, w], oldest first)`` -> logits ``[B, K, h, w]`` of the current
    frame: resize to ``(h // 2, w // 2)``, ``block`` over the T maps, ``classifier`` (a 1x1 conv,
    CFFM's ``linear_pred2``) on the current frame's map before and after it, resized back to
    ``(h, w)``.
    """

    def __init__(self, block: CFFMTemporalBlock, num_classes: int):
        super().__init__()
        self.block = block
        self.classifier = nn.Conv2d(2 * block.dim, num_classes, kernel_size=1)

    def prepare(self, fused_size: tuple[int, int]) -> None:
        """Build the block's layout for the half-size map of ``fused_size`` maps (issue 60)."""
        self.block.prepare(*decode_head_map_size(fused_size))

    def forward(self, fused: Tensor) -> Tensor:
        if fused.dim() != 5 or fused.shape[2] != self.block.dim:
            raise ValueError(
                f"TemporalDecodeHead expects fused maps [B, T, {self.block.dim}, h, w] "
                f"(the decoder's decoder_dim); got {tuple(fused.shape)}"
            )
        batch, num_frames, _, height, width = fused.shape
        half = F.interpolate(
            fused.flatten(0, 1), size=decode_head_map_size((height, width)), mode="bilinear"
        ).unflatten(0, (batch, num_frames))  # [B, T, D, h/2, w/2]
        after = self.block(list(half.unbind(1)))  # T x [B, D, h/2, w/2] -> [B, D, h/2, w/2]
        logits = self.classifier(torch.cat([half[:, -1], after], dim=1))  # [B, K, h/2, w/2]
        return F.interpolate(logits, size=(height, width), mode="bilinear")  # -> [B, K, h, w]

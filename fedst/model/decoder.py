"""FPN-style decoder with an efficient self-attention block (paper Fig. 2 "decoder"; Table V).

The four encoder maps [B, C_i, H_i, W_i] (strides 4..32) are projected to ``decoder_dim`` by 1x1
lateral convs, merged top-down (upsample + add, as in FPN), each merged level is upsampled to the
stride-4 grid and the four are fused by a 1x1 conv (+ GroupNorm + GELU). One transformer block
with PVT-style spatial-reduction attention (``q``, ``k``, ``v``, ``proj`` are separate nn.Linear
layers, so Table V's "decoder Attn.q" is addressable as ``decoder.blocks.<i>.attn.q.*``) refines
the fused map; a 1x1 head gives ``num_classes`` logits, bilinearly upsampled to the input size.

Normalisation: GroupNorm (``norm_groups`` groups) in the conv layers, LayerNorm in the attention
block. The paper trains with batch size 2, where BatchNorm statistics are noisy and averaging BN
running statistics across sites is ill-defined; GroupNorm has neither problem and no buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DecoderBlock", "FPNDecoder", "SpatialReductionAttention"]


class SpatialReductionAttention(nn.Module):
    """PVT-style attention: keys/values from a strided-conv-reduced map; tokens [B, N, C]."""

    def __init__(self, dim: int, num_heads: int, sr_ratio: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"decoder dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.sr_ratio = sr_ratio
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        if sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio)
            self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """x [B, N=h*w, C] -> [B, N, C]."""
        batch, tokens, dim = x.shape
        height, width = size
        context = x
        if self.sr_ratio > 1 and min(height, width) >= self.sr_ratio:
            grid = x.transpose(1, 2).reshape(batch, dim, height, width)  # [B, N, C] -> [B, C, h, w]
            grid = self.sr(grid)  # -> [B, C, h/sr, w/sr]
            context = self.norm(grid.flatten(2).transpose(1, 2))  # -> [B, N/sr^2, C]
        q = self._heads(self.q(x))  # [B, heads, N, C/heads]
        k = self._heads(self.k(context))  # [B, heads, M, C/heads]
        v = self._heads(self.v(context))
        out = F.scaled_dot_product_attention(q, k, v)  # [B, heads, N, C/heads]
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, dim))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        return x.reshape(batch, tokens, self.num_heads, dim // self.num_heads).transpose(1, 2)


class DecoderBlock(nn.Module):
    """Pre-norm transformer block: x + Attn(LN(x)), then x + MLP(LN(x)); map [B, C, h, w]."""

    def __init__(self, dim: int, num_heads: int, sr_ratio: int, mlp_ratio: float):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SpatialReductionAttention(dim, num_heads, sr_ratio)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, dim, height, width = x.shape
        tokens = x.flatten(2).transpose(1, 2)  # [B, C, h, w] -> [B, h*w, C]
        tokens = tokens + self.attn(self.norm1(tokens), (height, width))
        tokens = tokens + self.mlp(self.norm2(tokens))
        return tokens.transpose(1, 2).reshape(batch, dim, height, width)  # -> [B, C, h, w]


def _conv_norm_act(in_ch: int, out_ch: int, groups: int, kernel: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, kernel, padding=kernel // 2, bias=False),
        nn.GroupNorm(groups, out_ch),
        nn.GELU(),
    )


class FPNDecoder(nn.Module):
    """4 encoder maps -> logits [B, num_classes, H, W] (input size given by ``out_size``)."""

    def __init__(
        self,
        in_channels: Sequence[int],
        num_classes: int = 4,
        decoder_dim: int = 128,
        num_heads: int = 2,
        sr_ratio: int = 8,
        mlp_ratio: float = 2.0,
        num_blocks: int = 1,
        norm_groups: int = 8,
    ):
        super().__init__()
        if decoder_dim % norm_groups:
            raise ValueError(
                f"decoder_dim {decoder_dim} not divisible by norm_groups {norm_groups}"
            )
        self.lateral = nn.ModuleList(
            [_conv_norm_act(c, decoder_dim, norm_groups) for c in in_channels]
        )
        self.fuse = _conv_norm_act(decoder_dim * len(in_channels), decoder_dim, norm_groups)
        self.blocks = nn.ModuleList(
            [DecoderBlock(decoder_dim, num_heads, sr_ratio, mlp_ratio) for _ in range(num_blocks)]
        )
        self.head = nn.Conv2d(decoder_dim, num_classes, kernel_size=1)

    def forward(self, feats: Sequence[torch.Tensor], out_size: tuple[int, int]) -> torch.Tensor:
        """feats: 4 maps [B, C_i, H_i, W_i], finest first -> logits [B, num_classes, *out_size]."""
        return self.predict(self.fused_map(feats), out_size)

    def fused_map(self, feats: Sequence[torch.Tensor]) -> torch.Tensor:
        """feats: 4 maps [B, C_i, H_i, W_i], finest first -> the map the head reads
        [B, D, H_0, W_0] (fused at stride 4, after the transformer blocks)."""
        laterals = [
            conv(f) for conv, f in zip(self.lateral, feats, strict=True)
        ]  # [B, D, H_i, W_i]
        for level in range(len(laterals) - 2, -1, -1):  # top-down: coarse into fine
            coarse = F.interpolate(
                laterals[level + 1], size=laterals[level].shape[2:], mode="bilinear"
            )
            laterals[level] = laterals[level] + coarse
        size = laterals[0].shape[2:]
        upsampled = [laterals[0]] + [
            F.interpolate(m, size=size, mode="bilinear") for m in laterals[1:]
        ]
        x = self.fuse(torch.cat(upsampled, dim=1))  # [B, 4D, H/4, W/4] -> [B, D, H/4, W/4]
        for block in self.blocks:
            x = block(x)
        return x

    def predict(self, fused: torch.Tensor, out_size: tuple[int, int]) -> torch.Tensor:
        """fused [B, D, H/4, W/4] (:meth:`fused_map`) -> logits [B, num_classes, *out_size]."""
        logits = self.head(fused)  # [B, num_classes, H/4, W/4]
        return F.interpolate(logits, size=out_size, mode="bilinear")  # -> [B, num_classes, H, W]

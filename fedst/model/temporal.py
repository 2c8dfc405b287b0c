"""FedST temporal module: windowed multi-scale cross-attention over the current and earlier frames.

Paper: "Spatio-Temporal Representation Decoupling and Enhancement for Federated Instrument
Segmentation in Surgical Videos", Sec. III-B1 (RSC), Eq. 3-4.

Reading of the paper used here (see also DESIGN.md section 2):

* Input: one encoder stage's features of ``num_frames`` frames, oldest first,
  ``[F_{t-3}, F_{t-2}, F_{t-1}, F_t]``, each ``[B, C, h, w]``.
* The current map is split into ``s x s`` windows (maps not divisible by ``s`` are zero-padded; the
  output is cropped back). Window ``(i, j)`` covers pixels ``[i*s, (i+1)*s) x [j*s, (j+1)*s)``.
* Frame ``f`` with receptive field ``r_f`` and pooling size ``p_f`` is pooled by a learned FC over
  non-overlapping ``p x p`` cells (Eq. 3: ``[h/p, w/p, c*p^2] -> FC -> [h/p, w/p, c]``; the cell
  vector is ordered (row in cell, column in cell, channel); ``p = 1`` is the identity). A map not
  divisible by ``p`` is zero-padded, so border cells may be partly padding: they hold real content
  and stay valid context. Each window then takes the ``n x n`` pooled tokens, ``n = ceil(r / p)``,
  whose centre is nearest to the window centre (``context_token_start``). With the defaults
  ``r = (49, 20, 6, 7)``, ``p = (7, 4, 2, 1)``: 49 + 25 + 9 + 49 = 132 context tokens per window;
  the last entry is the window itself in the current frame.
* Context slots outside the (pooled) map - image borders and the zero padding of the current
  frame - are masked out of the softmax. Every window holds at least one real pixel of the current
  frame, so no softmax row is fully masked; the mask value is finite anyway, so even a fully
  masked row gives finite weights rather than NaN.
* Eq. 4 per window: ``F*_t = proj(Softmax(Q K^T / sqrt(d_head) + B) V) + F_t`` with
  ``Q = q(F_t window)``, ``K = k(c_hat)``, ``V = v(c_hat)``. The paper writes ``sqrt(c)``; with
  several heads each logit is a dot product over ``d_head = c / heads`` channels, so
  ``1/sqrt(d_head)`` is the scaling that keeps logits at unit variance (standard multi-head
  attention, and the same as the paper's formula for one head).
* ``B`` is a learned per-head table ``[heads, s*s, context_tokens]`` indexed by (query position in
  the window, context slot). Context slots are defined relative to the window, so the bias is
  relative: every window shares it.
* No pre-norm LayerNorm: Eq. 4 has none and the PVTv2 stage outputs this module reads already end
  in a LayerNorm. The residual is exactly ``F_t + attention output``.

Implementation: ``k`` and ``v`` are per-token linear maps, so they are applied once to every pooled
token of every frame and the per-window context is then gathered with one precomputed index
(``index_select``), instead of projecting the overlapping context of every window separately. The
index and validity mask depend only on ``(h, w)`` and are cached per map size and device.
Windows are batched as ``[B, num_windows * heads, tokens, d_head]`` (4-D, which the ONNX exporter
maps to its attention op) for ``F.scaled_dot_product_attention`` with an additive float mask
(bias + validity mask).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["TemporalCrossAttention", "check_window_attention", "context_token_start"]


def context_token_start(
    window_index: int | Tensor, window_size: int, pool_size: int, tokens_per_side: int
) -> int | Tensor:
    """First pooled-token index (along one axis) of window ``window_index``'s context.

    Window ``i`` spans pixels ``[i*s, (i+1)*s)``, centre ``i*s + s/2``; pooled token ``k`` spans
    pixels ``[k*p, (k+1)*p)``, centre ``(k + 1/2) * p``. The ``n`` consecutive tokens whose centre
    is nearest to the window centre start at ``floor((i*s + s/2) / p - (n - 1) / 2)`` (for even
    ``n`` and an exact tie, the lower start is taken). May be negative (outside the map).
    ``window_index`` may be a long tensor of window indices (element-wise floor division).
    """
    numerator = 2 * window_index * window_size + window_size - (tokens_per_side - 1) * pool_size
    return numerator // (2 * pool_size)


class TemporalCrossAttention(nn.Module):
    """Windowed multi-scale temporal cross-attention with relative position bias (Eq. 3-4).

    Args:
        dim: channels ``C`` of the stage's feature maps.
        num_heads: attention heads; must divide ``dim``.
        window_size: window side ``s`` on the current frame.
        receptive_fields: receptive field ``r`` per frame (pixels of this stage's map), oldest
            first. ``r`` not divisible by ``p`` is rounded up to whole cells, ``n = ceil(r / p)``
            tokens per side. The last entry is the current frame and must equal ``window_size``:
            its slots are the query window itself, so each window's own real pixels are always
            in its context.
        pool_sizes: pooling size ``p`` per frame, oldest first; the last entry must be 1.
        qkv_bias: bias in ``q``, ``k``, ``v``.
        attn_drop: dropout on the attention weights (training only).
        proj_drop: dropout after ``proj``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        window_size: int = 7,
        receptive_fields: Sequence[int] = (49, 20, 6, 7),
        pool_sizes: Sequence[int] = (7, 4, 2, 1),
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        receptive_fields = tuple(receptive_fields)
        pool_sizes = tuple(pool_sizes)
        _validate_arguments(
            dim, num_heads, window_size, receptive_fields, pool_sizes, attn_drop, proj_drop
        )
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.window_size = window_size
        self.receptive_fields = receptive_fields
        self.pool_sizes = pool_sizes
        self.num_frames = len(receptive_fields)
        self.tokens_per_side = tuple(
            math.ceil(r / p) for r, p in zip(receptive_fields, pool_sizes, strict=True)
        )
        self.context_tokens_per_window = sum(n * n for n in self.tokens_per_side)
        self.attn_drop = attn_drop

        # Eq. 3: one FC per frame over the c*p^2 values of each p x p cell; p = 1 is the identity.
        self.pool = nn.ModuleList(
            nn.Linear(dim * p * p, dim) if p > 1 else nn.Identity() for p in pool_sizes
        )
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.k = nn.Linear(dim, dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        # B in Eq. 4: [heads, query position in window, context slot].
        self.relative_position_bias = nn.Parameter(
            torch.zeros(num_heads, window_size * window_size, self.context_tokens_per_window)
        )
        nn.init.trunc_normal_(self.relative_position_bias, std=0.02)
        self._layout_cache: dict[tuple[int, int, str], tuple[Tensor, Tensor]] = {}

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, window_size={self.window_size}, "
            f"receptive_fields={self.receptive_fields}, pool_sizes={self.pool_sizes}, "
            f"context_tokens_per_window={self.context_tokens_per_window}"
        )

    def context_layout(self, h: int, w: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Gather index and validity of every window's context tokens for an ``h x w`` map.

        Returns:
            index: ``[num_windows * context_tokens]`` long, positions in the concatenation of all
                frames' flattened pooled maps (frame by frame, oldest first, each
                ``ceil(h/p) * ceil(w/p)`` tokens, row-major). Slots outside the map are clamped to
                a valid position; their values are ignored through ``valid``.
            valid: ``[num_windows, context_tokens]`` bool, False where a slot lies outside the
                pooled map (border, or zero padding of the current frame).
        Windows are row-major over ``ceil(h/s) x ceil(w/s)``; slots are frame by frame, each
        row-major over its ``n x n`` tokens.
        """
        key = (h, w, str(device))
        if key not in self._layout_cache:
            self._layout_cache[key] = self._build_layout(h, w, device)
        return self._layout_cache[key]

    def _build_layout(self, h: int, w: int, device: torch.device) -> tuple[Tensor, Tensor]:
        s = self.window_size
        windows_h, windows_w = math.ceil(h / s), math.ceil(w / s)
        indices, valids = [], []
        offset = 0
        for p, n in zip(self.pool_sizes, self.tokens_per_side, strict=True):
            pooled_h, pooled_w = math.ceil(h / p), math.ceil(w / p)
            rows = _context_positions(windows_h, s, p, n, device)  # [windows_h, n]
            cols = _context_positions(windows_w, s, p, n, device)  # [windows_w, n]
            # -> [windows_h, windows_w, n, n]
            row_grid = rows[:, None, :, None].expand(windows_h, windows_w, n, n)
            col_grid = cols[None, :, None, :].expand(windows_h, windows_w, n, n)
            valid = (
                (row_grid >= 0) & (row_grid < pooled_h) & (col_grid >= 0) & (col_grid < pooled_w)
            )
            flat = row_grid.clamp(0, pooled_h - 1) * pooled_w + col_grid.clamp(0, pooled_w - 1)
            indices.append(flat.reshape(windows_h * windows_w, n * n) + offset)
            valids.append(valid.reshape(windows_h * windows_w, n * n))
            offset += pooled_h * pooled_w
        index = torch.cat(indices, dim=1)  # [num_windows, context_tokens]
        return index.reshape(-1), torch.cat(valids, dim=1)

    def forward(self, frames: Sequence[Tensor]) -> Tensor:
        """frames: ``num_frames`` maps ``[B, C, h, w]``, oldest first -> F*_t ``[B, C, h, w]``.

        Eq. 3 pools each earlier frame, Eq. 4 cross-attends every ``s x s`` window of the current
        frame ``frames[-1]`` to its context and adds the result to ``F_t``.
        """
        self._validate_frames(frames)
        current = frames[-1]
        batch, channels, h, w = current.shape
        s, heads, head_dim = self.window_size, self.num_heads, self.head_dim
        windows_h, windows_w = math.ceil(h / s), math.ceil(w / s)
        num_windows = windows_h * windows_w
        tokens = self.context_tokens_per_window
        index, valid = self.context_layout(h, w, current.device)

        # Eq. 3 for every frame, then K and V once per pooled token: [B, sum_f pooled_f, C].
        per_frame = zip(frames, self.pool_sizes, self.pool, strict=True)
        pooled = torch.cat([_pool_cells(frame, p, fc) for frame, p, fc in per_frame], dim=1)
        key = self.k(pooled).index_select(1, index)  # [B, num_windows * tokens, C]
        value = self.v(pooled).index_select(1, index)
        # [B, num_windows * tokens, C] -> [B, num_windows, heads, tokens, head_dim]
        key = key.view(batch, num_windows, tokens, heads, head_dim).transpose(2, 3)
        value = value.view(batch, num_windows, tokens, heads, head_dim).transpose(2, 3)

        # Queries: [B, C, h, w] -> [B, num_windows, s*s, C] -> [B, num_windows, heads, s*s, hd]
        query_windows = _window_partition(current, s)
        query = self.q(query_windows).view(batch, num_windows, s * s, heads, head_dim)
        query = query.transpose(2, 3)

        # Additive mask: bias [heads, s*s, tokens] + validity [num_windows, 1, 1, tokens].
        mask_value = torch.finfo(query.dtype).min / 2
        invalid = torch.zeros(valid.shape, dtype=query.dtype, device=query.device)
        invalid = invalid.masked_fill(~valid, mask_value)
        attn_bias = self.relative_position_bias.to(query.dtype)[None] + invalid[:, None, None, :]

        # Windows folded into the head axis: [B, num_windows * heads, tokens, head_dim].
        attended = F.scaled_dot_product_attention(
            query.reshape(batch, num_windows * heads, s * s, head_dim),
            key.reshape(batch, num_windows * heads, tokens, head_dim),
            value.reshape(batch, num_windows * heads, tokens, head_dim),
            attn_mask=attn_bias.reshape(1, num_windows * heads, s * s, tokens),
            dropout_p=self.attn_drop if self.training else 0.0,
        ).view(batch, num_windows, heads, s * s, head_dim)
        attended = attended.transpose(2, 3).reshape(batch, num_windows, s * s, channels)
        attended = self.proj_drop(self.proj(attended))
        # [B, num_windows, s*s, C] -> [B, C, h, w]
        attended = _window_reverse(attended, s, windows_h, windows_w)[:, :, :h, :w]
        return current + attended  # Eq. 4 residual

    def _validate_frames(self, frames: Sequence[Tensor]) -> None:
        if len(frames) != self.num_frames:
            raise ValueError(
                f"TemporalCrossAttention expects {self.num_frames} frames (oldest first, current "
                f"last) to match receptive_fields={self.receptive_fields}; got {len(frames)}. "
                "Pass one feature map per configured frame."
            )
        shape = tuple(frames[-1].shape)
        if len(shape) != 4 or shape[1] != self.dim:
            raise ValueError(
                f"TemporalCrossAttention(dim={self.dim}) expects maps [B, {self.dim}, h, w]; the "
                f"current frame has shape {shape}. Check the encoder stage this module is "
                "attached to."
            )
        for position, frame in enumerate(frames):
            if tuple(frame.shape) != shape:
                raise ValueError(
                    f"all frames must share one shape; frame {position} has "
                    f"{tuple(frame.shape)}, the current frame {shape}. Feed frames of one clip "
                    "through the same encoder stage."
                )


def check_window_attention(name: str, dim: int, num_heads: int, window_size: int) -> None:
    """ValueError naming module ``name`` unless ``dim`` is a positive multiple of ``num_heads``
    and ``window_size >= 1`` (both temporal modules' first checks)."""
    if dim < 1 or num_heads < 1 or dim % num_heads:
        raise ValueError(f"{name}: dim={dim} must be a positive multiple of num_heads={num_heads}")
    if window_size < 1:
        raise ValueError(f"{name}: window_size={window_size} must be >= 1")


def _validate_arguments(
    dim: int,
    num_heads: int,
    window_size: int,
    receptive_fields: tuple[int, ...],
    pool_sizes: tuple[int, ...],
    attn_drop: float,
    proj_drop: float,
) -> None:
    name = "TemporalCrossAttention"
    check_window_attention(name, dim, num_heads, window_size)
    if not receptive_fields or len(receptive_fields) != len(pool_sizes):
        raise ValueError(
            f"{name}: receptive_fields={receptive_fields} and pool_sizes={pool_sizes} need one "
            "entry per frame (oldest first, current frame last) and the same length >= 1"
        )
    if any(v < 1 for v in receptive_fields + pool_sizes):
        raise ValueError(
            f"{name}: receptive_fields={receptive_fields} and pool_sizes={pool_sizes} must be "
            "positive integers"
        )
    if pool_sizes[-1] != 1 or receptive_fields[-1] != window_size:
        raise ValueError(
            f"{name}: the last entry is the current frame, whose context is the query window "
            f"itself: it needs pool size 1 and receptive field = window_size={window_size}; got "
            f"r={receptive_fields[-1]}, p={pool_sizes[-1]}"
        )
    for drop_name, drop in (("attn_drop", attn_drop), ("proj_drop", proj_drop)):
        if not 0.0 <= drop < 1.0:
            raise ValueError(f"{name}: {drop_name}={drop} must be in [0, 1)")


def _context_positions(
    num_windows: int, window_size: int, pool_size: int, tokens_per_side: int, device: torch.device
) -> Tensor:
    """Pooled-token positions along one axis for every window: ``[num_windows, n]`` long."""
    window = torch.arange(num_windows, device=device)
    start = context_token_start(window, window_size, pool_size, tokens_per_side)
    return start[:, None] + torch.arange(tokens_per_side, device=device)[None, :]


def _pool_cells(frame: Tensor, pool_size: int, fc: nn.Module) -> Tensor:
    """Eq. 3: ``[B, C, h, w]`` -> ``[B, ceil(h/p) * ceil(w/p), C]`` pooled tokens (row-major)."""
    batch, channels, h, w = frame.shape
    p = pool_size
    pooled_h, pooled_w = math.ceil(h / p), math.ceil(w / p)
    frame = F.pad(frame, (0, pooled_w * p - w, 0, pooled_h * p - h))
    # [B, C, H/p, p, W/p, p] -> [B, H/p, W/p, p, p, C] -> [B, H/p * W/p, p*p*C]
    cells = frame.reshape(batch, channels, pooled_h, p, pooled_w, p).permute(0, 2, 4, 3, 5, 1)
    cells = cells.reshape(batch, pooled_h * pooled_w, p * p * channels)
    return fc(cells)


def _window_partition(feature: Tensor, window_size: int) -> Tensor:
    """``[B, C, h, w]`` -> zero-padded ``[B, num_windows, s*s, C]`` (windows row-major)."""
    batch, channels, h, w = feature.shape
    s = window_size
    windows_h, windows_w = math.ceil(h / s), math.ceil(w / s)
    feature = F.pad(feature, (0, windows_w * s - w, 0, windows_h * s - h))
    # [B, C, Wh, s, Ww, s] -> [B, Wh, Ww, s, s, C]
    windows = feature.reshape(batch, channels, windows_h, s, windows_w, s).permute(0, 2, 4, 3, 5, 1)
    return windows.reshape(batch, windows_h * windows_w, s * s, channels)


def _window_reverse(windows: Tensor, window_size: int, windows_h: int, windows_w: int) -> Tensor:
    """``[B, num_windows, s*s, C]`` -> padded map ``[B, C, Wh*s, Ww*s]``."""
    batch, _, _, channels = windows.shape
    s = window_size
    # [B, Wh, Ww, s, s, C] -> [B, C, Wh, s, Ww, s]
    feature = windows.view(batch, windows_h, windows_w, s, s, channels).permute(0, 5, 1, 3, 2, 4)
    return feature.reshape(batch, channels, windows_h * s, windows_w * s)

"""FedST's temporal module as its reference builds it: CFFM's cross-frame focal block (Eq. 3-4).

The paper's r = {49, 20, 6, 7}, p = {7, 4, 2, 1}, window 7, frame interval, optimizer and batch are
those of CFFM (Sun et al., CVPR 2022; public code ``GuoleiSun/VSS-CFFM``,
``mmseg/models/decode_heads/cffm_module/cffm_transformer.py``: ``CffmTransformerBlock3d3`` and
``WindowAttention3d3``, configured in ``cffm_head.py`` with ``focal_l_clips=[1, 2, 3]``,
``focal_kernel_clips=[7, 5, 3]``, ``expand_size=3``, ``focal_level=2``, ``focal_window=5``,
``mlp_ratio=4``). CFFM's r = p x k: earlier frame ``f`` is resized so that every ``s x s`` window
holds exactly ``l_f x l_f`` pooled tokens (``p_f = s / l_f`` = 7, 3.5, 2.33 cells) and each window
attends a ``k_f x k_f`` block of them (``r_f = p_f k_f`` = 49, 17.5, 7 cells): the paper's numbers
rounded. docs/design-notes.md ("The temporal module against CFFM") compares it line by line.

One block, for frames ``[F_{t-3}, F_{t-2}, F_{t-1}, F_t]`` (oldest first), each ``[B, C, h, w]``:

1. pre-norm: ``LayerNorm`` on every frame; frames zero-padded to a multiple of ``s``.
2. the context of window ``(i, j)`` of the current frame, in this order of slots:
   * its own ``s x s`` cells (a Swin relative-position table ``(2s-1)^2`` per head);
   * the ring of ``e`` cells around it (``target_ring = e = 3``: CFFM's four rolled copies, 132
     slots with repeats; a free table ``[heads, s*s, 132]``);
   * the current frame pooled per window (``Linear(s*s, 1)``, mean-initialised), the
     ``f x f`` windows around it (``target_pooled = f = 5``; a relative table ``(s+f-1)^2``);
   * per earlier frame, the frame bilinearly resized to ``(l g)`` cells per window (``g = s // l``,
     7, 3, 2), pooled ``g x g`` by ``Linear(g*g, 1)`` (Eq. 3; CFFM's ``pool_method='fc'``, shared by
     channels, mean-initialised), and the ``k x k`` tokens around the window (a relative table
     ``(s+k-1)^2``).
3. Eq. 4: ``F*_t = F_t + proj(Softmax(Q K^T / sqrt(d_head) + B + mask) V)`` with ``Q`` from the
   window's normed cells and ``K``, ``V`` from its context; then ``F*_t + MLP(LN(F*_t))``
   (``mlp_ratio = 4``). Earlier frames are read, not changed.

Where this module departs from the reference, each a constructor choice:

* ``alignment="centred"`` (default): the ``k`` tokens of each earlier frame are the ones centred on
  the window (start ``i l + floor((l - k) / 2)``). CFFM's ``nn.Unfold(k, stride=l, padding=k//2)``
  starts at ``i l - k // 2``: the same for (l, k) = (1, 7) and (2, 5), but for t-1 (l = k = 3) it
  takes tokens ``[-1, 2)`` of the window, so the last 2.33 cells along each axis have no t-1 token
  over their own position. ``alignment="reference"`` reproduces it.
* Context slots outside the map (border, zero padding) are masked; CFFM masks the unfold padding
  but wraps its rolled ring around the map (``torch.roll``) and keeps the padded cells of the
  current frame.
* ``position_bias="reference"`` (default) gathers CFFM's tables through its index (query cell minus
  token index, so for a frame of 2.33-cell tokens one value is shared by geometrically different
  pairs); ``"free"`` gives every (query cell, slot) pair of each group its own value.

Layout: every gather index, validity mask and resize matrix depends only on ``(h, w)`` and is built
eagerly by :meth:`CFFMTemporalBlock.prepare` (also called by ``forward`` outside a compiled region),
so that ``torch.compile`` never traces index arithmetic (issue 60: inductor fails on the clamped
window start of a traced layout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedst.model.temporal import check_window_attention
from fedst.schema.network import ALIGNMENTS, POSITION_BIASES

__all__ = [
    "ALIGNMENTS",
    "POSITION_BIASES",
    "CFFMTemporalBlock",
    "bilinear_matrix",
    "context_start",
    "cross_relative_index",
    "ring_offsets",
    "window_relative_index",
]


def context_start(window: int, tokens_per_window: int, context_tokens: int, alignment: str) -> int:
    """First token (along one axis) of window ``window``'s ``k`` context tokens of a frame pooled to
    ``l`` tokens per window: ``i l + floor((l - k) / 2)`` centred, ``i l - k // 2`` as CFFM's
    unfold (stride ``l``, padding ``k // 2``). May be negative (outside the map)."""
    per_window, k = tokens_per_window, context_tokens
    if alignment == "centred":
        return window * per_window + (per_window - k) // 2
    return window * per_window - k // 2


def window_relative_index(window_size: int) -> Tensor:
    """Swin's relative index ``[s*s, s*s]`` into a ``(2s-1)^2`` table (query cell, key cell)."""
    coords = torch.stack(
        torch.meshgrid(torch.arange(window_size), torch.arange(window_size), indexing="ij")
    ).flatten(1)  # [2, s*s]
    relative = (coords[:, :, None] - coords[:, None, :]) + window_size - 1  # [2, s*s, s*s]
    return relative[0] * (2 * window_size - 1) + relative[1]


def cross_relative_index(window_size: int, context_tokens: int) -> Tensor:
    """CFFM's ``get_relative_position_index((s, s), (k, k))``: ``[s*s, k*k]`` into a
    ``(s+k-1)^2`` table, indexed by (query cell - context token) + (k - 1) along each axis."""
    s, k = window_size, context_tokens
    q = torch.stack(torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")).flatten(1)
    c = torch.stack(torch.meshgrid(torch.arange(k), torch.arange(k), indexing="ij")).flatten(1)
    relative = q[:, :, None] - c[:, None, :] + (k - 1)  # [2, s*s, k*k]
    return relative[0] * (s + k - 1) + relative[1]


def ring_offsets(window_size: int, ring: int) -> list[tuple[int, int]]:
    """Cell offsets, relative to a window's first cell, of CFFM's ring slots (``expand_size``):
    for each roll (top-left, top-right, bottom-left, bottom-right) the window's cells of the rolled
    map that come from outside the window, row-major: ``4 s^2 - 4 (s - e)^2`` slots (132 for
    s = 7, e = 3), some cells twice, as in CFFM (``valid_ind_rolled``)."""
    s, e = window_size, ring
    offsets = []
    # torch.roll(t, shifts=(dy, dx))[y, x] = t[y - dy, x - dx]; CFFM's shifts per corner:
    for dy, dx in ((-e, -e), (-e, e), (e, -e), (e, e)):
        for a in range(s):
            for b in range(s):
                source = (a - dy, b - dx)
                if not (0 <= source[0] < s and 0 <= source[1] < s):
                    offsets.append(source)
    return offsets


def bilinear_matrix(size_in: int, size_out: int) -> Tensor:
    """``[size_out, size_in]`` float: one axis of ``F.interpolate(mode="bilinear",
    align_corners=False)`` from ``size_in`` to ``size_out`` samples, as a matrix (source
    coordinate ``(o + 0.5) size_in / size_out - 0.5``, clamped at 0; the upper neighbour clamped
    at the last sample)."""
    matrix = torch.zeros(size_out, size_in, dtype=torch.float64)
    scale = size_in / size_out
    for o in range(size_out):
        source = max((o + 0.5) * scale - 0.5, 0.0)
        low = min(math.floor(source), size_in - 1)
        high = min(low + 1, size_in - 1)
        frac = source - low
        matrix[o, low] += 1.0 - frac
        matrix[o, high] += frac
    return matrix.float()


@dataclass(frozen=True)
class _Group:
    """One group of context slots: its bias table's name and its slot count per window."""

    name: str
    slots: int


class CFFMTemporalBlock(nn.Module):
    """CFFM's cross-frame focal block on one feature map (Eq. 3-4; module docstring).

    Args:
        dim: channels ``C`` of the maps.
        num_heads: attention heads; must divide ``dim``.
        window_size: window side ``s`` on the current frame (7).
        tokens_per_window: ``l`` per earlier frame, oldest first (CFFM: 1, 2, 3).
        context_tokens: ``k`` per earlier frame, oldest first (CFFM: 7, 5, 3; odd).
        target_ring: ``e``, cells of the current frame's ring around each window (0: none).
        target_pooled: ``f``, window-pooled tokens of the current frame per side (0: none; odd).
        mlp_ratio: hidden width of the MLP after attention, in ``dim`` (0: no MLP).
        alignment: "centred" | "reference" (which ``k`` tokens a window takes).
        position_bias: "reference" (CFFM's relative tables) | "free" (a value per query and slot).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        window_size: int = 7,
        tokens_per_window: Sequence[int] = (1, 2, 3),
        context_tokens: Sequence[int] = (7, 5, 3),
        target_ring: int = 3,
        target_pooled: int = 5,
        mlp_ratio: float = 4.0,
        alignment: str = "centred",
        position_bias: str = "reference",
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        tokens_per_window, context_tokens = tuple(tokens_per_window), tuple(context_tokens)
        _validate(
            dim, num_heads, window_size, tokens_per_window, context_tokens, target_ring,
            target_pooled, alignment, position_bias,
        )  # fmt: skip
        s = window_size
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.window_size = s
        self.tokens_per_window, self.context_tokens = tokens_per_window, context_tokens
        self.pool_cells = tuple(s // n for n in tokens_per_window)  # g: 7, 3, 2
        self.target_ring, self.target_pooled = target_ring, target_pooled
        self.alignment, self.position_bias = alignment, position_bias
        self.num_frames = len(tokens_per_window) + 1
        self.attn_drop = attn_drop

        self.norm1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.k = nn.Linear(dim, dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.norm2 = nn.LayerNorm(dim) if mlp_ratio > 0 else None
        hidden = int(dim * mlp_ratio)
        self.mlp = (
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
            if mlp_ratio > 0
            else None
        )
        # Eq. 3 as CFFM's 'fc' pooling: Linear(g*g, 1) over a cell's positions, shared by channels.
        self.pool_target = _mean_pool(s * s) if target_pooled else None
        self.pool_frames = nn.ModuleList(_mean_pool(g * g) for g in self.pool_cells)

        # B (Eq. 4): one table per group of slots, gathered through a fixed index.
        groups = [_Group("window", s * s)]
        tables = {"window": ((2 * s - 1) ** 2, window_relative_index(s))}
        if target_ring:
            ring = len(ring_offsets(s, target_ring))
            groups.append(_Group("ring", ring))
            tables["ring"] = (s * s * ring, torch.arange(s * s * ring).view(s * s, ring))
        if target_pooled:
            groups.append(_Group("pooled", target_pooled**2))
            f = target_pooled
            tables["pooled"] = ((s + f - 1) ** 2, cross_relative_index(s, f))
        for index, k in enumerate(context_tokens):
            groups.append(_Group(f"frame{index}", k * k))
            tables[f"frame{index}"] = ((s + k - 1) ** 2, cross_relative_index(s, k))
        self.groups = tuple(groups)
        self.context_slots = sum(g.slots for g in groups)
        self.bias_tables = nn.ParameterDict()
        for group in groups:
            size, index = tables[group.name]
            if position_bias == "free":  # a value per (query cell, slot)
                size, index = s * s * group.slots, torch.arange(s * s * group.slots)
            table = nn.Parameter(torch.zeros(num_heads, size))
            nn.init.trunc_normal_(table, std=0.02)
            self.bias_tables[group.name] = table
            self.register_buffer(f"bias_index_{group.name}", index.reshape(-1), persistent=False)
        self._layouts: dict[tuple[int, int], dict[str, str]] = {}
        """(h, w) -> {layout entry: the name of the buffer holding it} (:meth:`prepare`)."""

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, window_size={self.window_size}, "
            f"tokens_per_window={self.tokens_per_window}, context_tokens={self.context_tokens}, "
            f"target_ring={self.target_ring}, target_pooled={self.target_pooled}, "
            f"alignment={self.alignment!r}, position_bias={self.position_bias!r}, "
            f"context_slots={self.context_slots}"
        )

    # -- layout: built eagerly, never inside a compiled graph ------------------------------------
    def prepare(self, h: int, w: int) -> None:
        """Build (once) the gather index, validity and resize matrices for ``h x w`` maps on this
        module's device. Call before ``torch.compile`` for every map size the model will see."""
        if (h, w) in self._layouts:
            return
        device = self.q.weight.device
        names = {}
        for name, tensor in self.build_layout(h, w).items():  # buffers: moved by .to(), not saved
            names[name] = f"layout_{h}x{w}_{name}"
            self.register_buffer(names[name], tensor.to(device), persistent=False)
        self._layouts[(h, w)] = names

    def _layout(self, h: int, w: int) -> dict[str, Tensor]:
        if (h, w) not in self._layouts:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    f"CFFMTemporalBlock: no layout for {h}x{w} maps inside a compiled region; "
                    "call model.prepare_temporal(image_size) (or this module's prepare(h, w)) "
                    "before torch.compile"
                )
            self.prepare(h, w)
        return {name: getattr(self, buffer) for name, buffer in self._layouts[(h, w)].items()}

    def build_layout(self, h: int, w: int) -> dict[str, Tensor]:
        """The size-dependent layout of ``h x w`` maps (CPU tensors):

        * ``index`` ``[num_windows * context_slots]`` long: positions in the token bank
          (current frame's padded cells ``Hp*Wp``, row-major; its window-pooled tokens; each
          earlier frame's pooled tokens, oldest first), slot order as :attr:`groups`;
        * ``valid`` ``[num_windows, context_slots]`` bool: False where a slot lies outside the map;
        * ``resize_rows{f}`` ``[l g nWh, Hp]`` / ``resize_cols{f}`` ``[l g nWw, Wp]``: bilinear
          resize of earlier frame f (absent where no resize is needed).
        """
        s, e, fp = self.window_size, self.target_ring, self.target_pooled
        windows_h, windows_w = math.ceil(h / s), math.ceil(w / s)
        padded_h, padded_w = windows_h * s, windows_w * s
        rows, cols = torch.meshgrid(torch.arange(windows_h), torch.arange(windows_w), indexing="ij")
        top, left = (rows.reshape(-1) * s)[:, None], (cols.reshape(-1) * s)[:, None]  # [nW, 1]
        indices, valids, layout = [], [], {}

        def cells(dy: Tensor, dx: Tensor) -> None:  # offsets [n] from each window's first cell
            y, x = top + dy[None], left + dx[None]  # [nW, n]
            valids.append((y >= 0) & (y < h) & (x >= 0) & (x < w))
            indices.append(y.clamp(0, padded_h - 1) * padded_w + x.clamp(0, padded_w - 1))

        a, b = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
        cells(a.reshape(-1), b.reshape(-1))  # own window
        if e:
            ring = torch.tensor(ring_offsets(s, e))  # [slots, 2]
            cells(ring[:, 0], ring[:, 1])
        offset = padded_h * padded_w
        if fp:
            self._tokens(windows_h, windows_w, 1, fp, -(fp // 2), offset, indices, valids)
            offset += windows_h * windows_w
        frames = zip(self.tokens_per_window, self.context_tokens, self.pool_cells, strict=True)
        for f, (n, k, g) in enumerate(frames):  # n = l tokens per window side
            start = context_start(0, n, k, self.alignment)
            self._tokens(windows_h, windows_w, n, k, start, offset, indices, valids)
            offset += windows_h * n * windows_w * n
            if n * g != s:
                layout[f"resize_rows{f}"] = bilinear_matrix(padded_h, windows_h * n * g)
                layout[f"resize_cols{f}"] = bilinear_matrix(padded_w, windows_w * n * g)
        layout["index"] = torch.cat(indices, dim=1).reshape(-1)
        layout["valid"] = torch.cat(valids, dim=1)
        return layout

    @staticmethod
    def _tokens(
        windows_h: int,
        windows_w: int,
        per_window: int,
        context: int,
        start: int,
        offset: int,
        indices: list[Tensor],
        valids: list[Tensor],
    ) -> None:
        """Append the ``context x context`` tokens of a grid of ``per_window`` tokens per window
        side, starting ``start`` tokens from each window's first token."""
        grid_h, grid_w = windows_h * per_window, windows_w * per_window
        rows = torch.arange(windows_h)[:, None] * per_window + start + torch.arange(context)
        cols = torch.arange(windows_w)[:, None] * per_window + start + torch.arange(context)
        y = rows[:, None, :, None].expand(windows_h, windows_w, context, context)
        x = cols[None, :, None, :].expand(windows_h, windows_w, context, context)
        valid = (y >= 0) & (y < grid_h) & (x >= 0) & (x < grid_w)
        flat = y.clamp(0, grid_h - 1) * grid_w + x.clamp(0, grid_w - 1) + offset
        indices.append(flat.reshape(windows_h * windows_w, context * context))
        valids.append(valid.reshape(windows_h * windows_w, context * context))

    # -- forward ----------------------------------------------------------------------------------
    def position_bias_matrix(self) -> Tensor:
        """B: ``[heads, s*s, context_slots]``, every group's table gathered through its index."""
        s2 = self.window_size**2
        parts = [
            self.bias_tables[g.name]
            .index_select(1, getattr(self, f"bias_index_{g.name}"))
            .view(self.num_heads, s2, g.slots)
            for g in self.groups
        ]
        return torch.cat(parts, dim=2)

    def forward(self, frames: Sequence[Tensor]) -> Tensor:
        """frames: ``num_frames`` maps ``[B, C, h, w]``, oldest first -> F*_t ``[B, C, h, w]``."""
        self._validate_frames(frames)
        current = frames[-1]
        batch, channels, h, w = current.shape
        s, heads, head_dim = self.window_size, self.num_heads, self.head_dim
        windows_h, windows_w = math.ceil(h / s), math.ceil(w / s)
        num_windows, slots = windows_h * windows_w, self.context_slots
        layout = self._layout(h, w)

        # Pre-norm and zero padding: T x [B, C, h, w] -> [B, T, Hp, Wp, C]
        normed = self.norm1(torch.stack(frames, dim=1).permute(0, 1, 3, 4, 2))
        normed = F.pad(normed, (0, 0, 0, windows_w * s - w, 0, windows_h * s - h))
        target = normed[:, -1]  # [B, Hp, Wp, C]
        bank = [target.reshape(batch, -1, channels)]  # the current frame's cells
        if self.pool_target is not None:
            bank.append(_pool(target, s, self.pool_target))  # [B, nWh*nWw, C]
        for f, (g, pool) in enumerate(zip(self.pool_cells, self.pool_frames, strict=True)):
            frame = normed[:, f]  # [B, Hp, Wp, C]
            if f"resize_rows{f}" in layout:  # bilinear resize to l*g cells per window
                rows, cols = layout[f"resize_rows{f}"], layout[f"resize_cols{f}"]
                frame = torch.einsum(
                    "oh,bhwc,pw->bopc", rows.to(frame.dtype), frame, cols.to(frame.dtype)
                )
            bank.append(_pool(frame, g, pool))  # [B, (l nWh) * (l nWw), C]
        bank = torch.cat(bank, dim=1)  # [B, N, C]

        # K, V once per bank token, then each window's context: [B, nW, heads, slots, hd]
        index = layout["index"]
        key = self.k(bank).index_select(1, index).view(batch, num_windows, slots, heads, head_dim)
        value = self.v(bank).index_select(1, index)
        value = value.view(batch, num_windows, slots, heads, head_dim)
        query = self.q(_windows(target, s)).view(batch, num_windows, s * s, heads, head_dim)

        mask_value = torch.finfo(query.dtype).min / 2
        invalid = torch.zeros(layout["valid"].shape, dtype=query.dtype, device=query.device)
        invalid = invalid.masked_fill(~layout["valid"], mask_value)  # [nW, slots]
        attn_bias = self.position_bias_matrix().to(query.dtype)[None] + invalid[:, None, None, :]
        attended = F.scaled_dot_product_attention(
            query.transpose(2, 3).reshape(batch, num_windows * heads, s * s, head_dim),
            key.transpose(2, 3).reshape(batch, num_windows * heads, slots, head_dim),
            value.transpose(2, 3).reshape(batch, num_windows * heads, slots, head_dim),
            attn_mask=attn_bias.reshape(1, num_windows * heads, s * s, slots),
            dropout_p=self.attn_drop if self.training else 0.0,
        )  # [B, nW*heads, s*s, hd]
        attended = attended.view(batch, num_windows, heads, s * s, head_dim).transpose(2, 3)
        attended = self.proj_drop(self.proj(attended.reshape(batch, num_windows, s * s, channels)))
        attended = attended.view(batch, windows_h, windows_w, s, s, channels)
        attended = attended.permute(0, 1, 3, 2, 4, 5).reshape(
            batch, windows_h * s, windows_w * s, channels
        )
        out = current.permute(0, 2, 3, 1) + attended[:, :h, :w]  # Eq. 4 residual: [B, h, w, C]
        if self.mlp is not None:
            out = out + self.mlp(self.norm2(out))
        return out.permute(0, 3, 1, 2)  # [B, C, h, w]

    def _validate_frames(self, frames: Sequence[Tensor]) -> None:
        if len(frames) != self.num_frames:
            raise ValueError(
                f"CFFMTemporalBlock expects {self.num_frames} frames (oldest first, current last) "
                f"to match tokens_per_window={self.tokens_per_window}; got {len(frames)}"
            )
        shape = tuple(frames[-1].shape)
        if len(shape) != 4 or shape[1] != self.dim:
            raise ValueError(
                f"CFFMTemporalBlock(dim={self.dim}) expects maps [B, {self.dim}, h, w]; the current "
                f"frame has shape {shape}. Check the stage this module is attached to."
            )
        for position, frame in enumerate(frames):
            if tuple(frame.shape) != shape:
                raise ValueError(
                    f"all frames must share one shape; frame {position} has "
                    f"{tuple(frame.shape)}, the current frame {shape}"
                )


def _mean_pool(cells: int) -> nn.Linear:
    """``Linear(cells, 1)`` initialised to the mean (CFFM: weight 1/cells, bias 0)."""
    pool = nn.Linear(cells, 1)
    nn.init.constant_(pool.weight, 1.0 / cells)
    nn.init.zeros_(pool.bias)
    return pool


def _pool(frame: Tensor, cell: int, fc: nn.Linear) -> Tensor:
    """``[B, H, W, C]`` -> ``[B, (H/cell) * (W/cell), C]``: ``fc`` over each cell's positions."""
    batch, height, width, channels = frame.shape
    rows, cols = height // cell, width // cell
    # [B, rows, cell, cols, cell, C] -> [B, rows, cols, C, cell*cell]
    grouped = frame.reshape(batch, rows, cell, cols, cell, channels).permute(0, 1, 3, 5, 2, 4)
    pooled = fc(grouped.reshape(batch, rows, cols, channels, cell * cell)).squeeze(-1)
    return pooled.reshape(batch, rows * cols, channels)


def _windows(frame: Tensor, window_size: int) -> Tensor:
    """``[B, Hp, Wp, C]`` -> ``[B, num_windows, s*s, C]`` (windows row-major)."""
    batch, height, width, channels = frame.shape
    s = window_size
    grouped = frame.reshape(batch, height // s, s, width // s, s, channels).permute(
        0, 1, 3, 2, 4, 5
    )
    return grouped.reshape(batch, (height // s) * (width // s), s * s, channels)


def _validate(
    dim: int,
    num_heads: int,
    window_size: int,
    tokens_per_window: tuple[int, ...],
    context_tokens: tuple[int, ...],
    target_ring: int,
    target_pooled: int,
    alignment: str,
    position_bias: str,
) -> None:
    name = "CFFMTemporalBlock"
    check_window_attention(name, dim, num_heads, window_size)
    if not tokens_per_window or len(tokens_per_window) != len(context_tokens):
        raise ValueError(
            f"{name}: tokens_per_window={tokens_per_window} and context_tokens={context_tokens} "
            "need one entry per earlier frame (oldest first), the same length >= 1"
        )
    if any(not 1 <= n <= window_size for n in tokens_per_window):
        raise ValueError(
            f"{name}: tokens_per_window={tokens_per_window} must lie in 1..window_size={window_size}"
        )
    if any(k < 1 or k % 2 == 0 for k in context_tokens):
        raise ValueError(f"{name}: context_tokens={context_tokens} must be positive odd numbers")
    if not 0 <= target_ring < window_size:
        raise ValueError(f"{name}: target_ring={target_ring} must lie in 0..window_size-1")
    if target_pooled < 0 or (target_pooled and target_pooled % 2 == 0):
        raise ValueError(
            f"{name}: target_pooled={target_pooled} must be 0 or a positive odd number"
        )
    if alignment not in ALIGNMENTS:
        raise ValueError(f"{name}: alignment={alignment!r}; choose one of {ALIGNMENTS}")
    if position_bias not in POSITION_BIASES:
        raise ValueError(
            f"{name}: position_bias={position_bias!r}; choose one of {POSITION_BIASES}"
        )

"""PVTv2 encoder (b0-b5, b2_li) whose attention has separately named ``q``, ``k``, ``v`` Linears.

Paper: `PVT v2: Improved Baselines with Pyramid Vision Transformer`, Wang et al. 2022,
https://arxiv.org/abs/2106.13797 (official code: https://github.com/whai362/PVT).

Origin: built on timm's ``timm/models/pvt_v2.py`` (Ross Wightman, Apache 2.0). The model is created
by timm's own registered factory, so configurations (embed dims, heads, MLP ratios, depths, SR
ratios, norms), patch embeds, stages, MLPs and initialisation are timm's. Only each block's
attention is replaced by :class:`Attention`, whose fused ``kv`` Linear(C, 2C) is split into ``k``
(rows [0:C]) and ``v`` (rows [C:2C]), so personalisation rules (FedST Tables V/VI, FedDP "query
personalisation") can select ``*.attn.q.*``, ``*.attn.k.*`` or ``*.attn.v.*`` by name. The
classification head is dropped: the encoder returns the 4 stage feature maps.

Parameter names (prefix ``stages.{i}.blocks.{j}.``): ``attn.q``, ``attn.k``, ``attn.v``,
``attn.proj``, ``attn.sr`` / ``attn.norm`` (spatial reduction), ``norm1``, ``norm2``, ``mlp.fc1``,
``mlp.dwconv``, ``mlp.fc2``; plus ``patch_embed.proj|norm``, ``stages.{i}.downsample.proj|norm``
(i > 0) and ``stages.{i}.norm``. Every LayerNorm name contains ``norm``.

Checkpoints accepted by :func:`load_pretrained`: the official release
(``block1.0.attn.kv.weight``), timm's (``stages.0.blocks.0.attn.kv.weight``) and our own split
keys; see :func:`checkpoint_filter_fn`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
import torch
import torch.nn.functional as F
from timm.layers import use_fused_attn
from timm.models import pvt_v2 as timm_pvt_v2
from torch import nn

from .weights import read_state_dict, resolve_pretrained

__all__ = [
    "PVT_V2_VARIANTS",
    "Attention",
    "CheckpointMismatchError",
    "LoadReport",
    "PvtV2Encoder",
    "checkpoint_filter_fn",
    "create_pvt_v2",
    "load_pretrained",
    "pvt_v2_b0",
    "pvt_v2_b1",
    "pvt_v2_b2",
    "pvt_v2_b2_li",
    "pvt_v2_b3",
    "pvt_v2_b4",
    "pvt_v2_b5",
    "split_fused_kv",
]

_logger = logging.getLogger(__name__)

PVT_V2_VARIANTS = (
    "pvt_v2_b0",
    "pvt_v2_b1",
    "pvt_v2_b2",
    "pvt_v2_b3",
    "pvt_v2_b4",
    "pvt_v2_b5",
    "pvt_v2_b2_li",
)
DEFAULT_DROP_PATH_RATE = 0.1
_FUSED_KV_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?)kv\.(?P<param>weight|bias)$")
_WRAPPER_KEYS = ("state_dict", "model")
_HEAD_PREFIX = "head."
_DDP_PREFIX = "module."


class Attention(nn.Module):
    """PVTv2 spatial-reduction attention (PVTv2 paper Eq. 1-2) with separate q, k, v Linears.

    Numerically identical to timm's ``Attention`` (same ``sr``/``norm`` reduction, same linear
    SRA option with 7x7 average pooling, same fused SDPA path). Tokens x: [B, N, C], N = H * W.
    """

    fused_attn: torch.jit.Final[bool]

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        sr_ratio: int = 1,
        linear_attn: bool = False,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"attention dim {dim} is not divisible by num_heads {num_heads}")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.sr_ratio = sr_ratio
        self.linear_attn = linear_attn
        self.fused_attn = use_fused_attn()

        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.k = nn.Linear(dim, dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

        self.pool: nn.Module | None = None
        self.sr: nn.Module | None = None
        self.norm: nn.Module | None = None
        self.act: nn.Module | None = None
        if linear_attn:
            self.pool = nn.AdaptiveAvgPool2d(7)
            self.sr = nn.Conv2d(dim, dim, kernel_size=1, stride=1)
            self.norm = nn.LayerNorm(dim)
            self.act = nn.GELU()
        elif sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio)
            self.norm = nn.LayerNorm(dim)

    @classmethod
    def from_timm(cls, attn: timm_pvt_v2.Attention) -> Attention:
        """Same configuration and weights as timm's fused-kv ``attn``, with ``kv`` split."""
        linear_attn = attn.pool is not None
        sr_ratio = attn.sr.kernel_size[0] if attn.sr is not None and not linear_attn else 1
        with torch.device(attn.q.weight.device):  # "meta" builds large variants without init
            split = cls(
                dim=attn.dim,
                num_heads=attn.num_heads,
                sr_ratio=sr_ratio,
                linear_attn=linear_attn,
                qkv_bias=attn.q.bias is not None,
                attn_drop=attn.attn_drop.p,
                proj_drop=attn.proj_drop.p,
            )
        split.load_state_dict(split_fused_kv(attn.state_dict()), assign=True)
        return split

    def _key_value_tokens(self, x: torch.Tensor, feat_size: tuple[int, int]) -> torch.Tensor:
        """Tokens that keys and values come from: [B, N, C] -> [B, N', C] (N' = N / sr^2 or 49)."""
        if self.sr is None:
            return x
        batch, _, channels = x.shape
        height, width = feat_size
        x = x.permute(0, 2, 1).reshape(batch, channels, height, width)  # [B, C, H, W]
        if self.pool is not None:
            x = self.pool(x)  # [B, C, 7, 7]
        x = self.sr(x).reshape(batch, channels, -1).permute(0, 2, 1)  # [B, N', C]
        x = self.norm(x)
        if self.act is not None:
            x = self.act(x)
        return x

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N, C] -> [B, heads, N, head_dim]."""
        batch, tokens, _ = x.shape
        return x.reshape(batch, tokens, self.num_heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor, feat_size: tuple[int, int]) -> torch.Tensor:
        """x: [B, N, C] tokens of an H x W map (feat_size = (H, W)) -> [B, N, C]."""
        batch, tokens, channels = x.shape
        q = self._heads(self.q(x))  # [B, heads, N, head_dim]
        source = self._key_value_tokens(x, feat_size)  # [B, N', C]
        k = self._heads(self.k(source))  # [B, heads, N', head_dim]
        v = self._heads(self.v(source))
        if self.fused_attn:
            x = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0
            )
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)  # [B, heads, N, N']
            attn = self.attn_drop(attn.softmax(dim=-1))
            x = attn @ v
        x = x.transpose(1, 2).reshape(batch, tokens, channels)  # [B, N, C]
        return self.proj_drop(self.proj(x))


class PvtV2Encoder(nn.Module):
    """PVTv2 feature encoder: timm's patch embed and stages, split q/k/v attention, no head.

    ``forward(x [B, 3, H, W])`` returns 4 maps [B, C_i, H_i, W_i] with C_i = ``embed_dims[i]`` and
    strides 4, 8, 16, 32. Any H, W >= 29 (b2_li: >= 1) works: H_1 = ceil(H / 4) and
    H_{i+1} = ceil(H_i / 2) (overlapping convs with padding), see :meth:`feature_sizes`.
    Takes over ``backbone``'s modules (its blocks get the split attention); the head is dropped.
    """

    def __init__(self, backbone: timm_pvt_v2.PyramidVisionTransformerV2) -> None:
        super().__init__()
        self.variant: str | None = getattr(backbone, "pretrained_cfg", {}).get("architecture")
        self.in_chans = backbone.in_chans
        self.patch_embed = backbone.patch_embed
        self.stages = backbone.stages
        for stage in self.stages:
            for block in stage.blocks:
                block.attn = Attention.from_timm(block.attn)
        dims = tuple(int(info["num_chs"]) for info in backbone.feature_info)
        if len(dims) != 4:
            raise ValueError(f"PvtV2Encoder expects 4 stages, timm model has {len(dims)}: {dims}")
        self.embed_dims: tuple[int, int, int, int] = dims
        self.reductions = tuple(int(info["reduction"]) for info in backbone.feature_info)
        self.sr_ratios = tuple(stage.blocks[0].attn.sr_ratio for stage in self.stages)
        self.linear_attn = bool(self.stages[0].blocks[0].attn.linear_attn)

    def feature_sizes(self, height: int, width: int) -> list[tuple[int, int]]:
        """(H_i, W_i) of the 4 output maps for an H x W input, from the patch-embed convs."""
        sizes = []
        embeds = [self.patch_embed] + [stage.downsample for stage in self.stages[1:]]
        for embed in embeds:
            conv = embed.proj
            height, width = (
                (size + 2 * pad - kernel) // stride + 1
                for size, pad, kernel, stride in zip(
                    (height, width), conv.padding, conv.kernel_size, conv.stride, strict=True
                )
            )
            sizes.append((height, width))
        return sizes

    def _check_input(self, x: torch.Tensor) -> None:
        if x.ndim != 4 or x.shape[1] != self.in_chans:
            raise ValueError(
                f"PvtV2Encoder expects images [B, {self.in_chans}, H, W], got {tuple(x.shape)}"
            )
        if self.linear_attn:
            return
        for stage, ((height, width), sr_ratio) in enumerate(
            zip(self.feature_sizes(x.shape[2], x.shape[3]), self.sr_ratios, strict=True)
        ):
            if min(height, width) < sr_ratio:
                raise ValueError(
                    f"input {tuple(x.shape[2:])} is too small: stage {stage} map is "
                    f"{height}x{width}, below its spatial-reduction ratio {sr_ratio}; "
                    f"use inputs of at least 29x29"
                )

    def forward(self, x: torch.Tensor, num_stages: int = 4) -> list[torch.Tensor]:
        """x: [B, 3, H, W] -> [[B, C_1, H/4, W/4], [B, C_2, H/8, W/8], ..., [B, C_4, H/32, W/32]]

        (sizes rounded up, see :meth:`feature_sizes`); with ``num_stages`` < 4 only the first
        ``num_stages`` maps, the later stages not run."""
        if not 1 <= num_stages <= len(self.stages):
            raise ValueError(f"num_stages={num_stages}: choose 1..{len(self.stages)}")
        self._check_input(x)
        x = self.patch_embed(x)  # [B, 3, H, W] -> [B, H/4, W/4, C_1] (channels last)
        features = []
        for stage in self.stages[:num_stages]:
            x = stage(x)  # -> [B, C_i, H_i, W_i]
            features.append(x)
        return features

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute block activations in backward to save memory."""
        for stage in self.stages:
            stage.grad_checkpointing = enable


def split_fused_kv(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace every ``*kv.weight`` [2C, C] / ``*kv.bias`` [2C] by ``*k.*`` (rows [0:C]) and
    ``*v.*`` (rows [C:2C]); other keys pass unchanged (timm reshapes kv output as (2, heads, d)).
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        match = _FUSED_KV_KEY.match(key)
        if match is None:
            out[key] = value
            continue
        if value.shape[0] % 2 != 0:
            raise ValueError(f"fused kv tensor '{key}' has odd first dim {tuple(value.shape)}")
        channels = value.shape[0] // 2
        prefix, param = match["prefix"], match["param"]
        out[f"{prefix}k.{param}"] = value[:channels].clone()
        out[f"{prefix}v.{param}"] = value[channels:].clone()
    return out


def checkpoint_filter_fn(
    state_dict: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Any accepted key style -> our keys; returns (encoder state, dropped head keys).

    Steps: strip a DDP ``module.`` prefix; official names -> timm names (timm's own
    ``checkpoint_filter_fn``: ``patch_embed{i}``, ``block{i}.{j}``, ``norm{i}``, ``dwconv.dwconv``);
    drop ``head.*``; split fused ``kv`` into ``k`` and ``v``.
    """
    state = dict(state_dict)
    if state and all(key.startswith(_DDP_PREFIX) for key in state):
        state = {key[len(_DDP_PREFIX) :]: value for key, value in state.items()}
    state = timm_pvt_v2.checkpoint_filter_fn(state, None)
    dropped = sorted(key for key in state if key.startswith(_HEAD_PREFIX))
    state = {key: value for key, value in state.items() if not key.startswith(_HEAD_PREFIX)}
    return split_fused_kv(state), dropped


class CheckpointMismatchError(ValueError):
    """A checkpoint whose keys or shapes do not fit the encoder."""


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_pretrained` did: key style found, keys loaded / missing / unexpected."""

    source: str
    key_style: str
    loaded: int
    missing: list[str]
    unexpected: list[str]
    dropped_head: list[str]


def _unwrap(checkpoint: Mapping[str, Any], source: str) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint, unwrapping ``{"state_dict": ...}`` / ``{"model": ...}``."""
    unwrapped = True
    while unwrapped:
        unwrapped = False
        for key in _WRAPPER_KEYS:
            if isinstance(checkpoint.get(key), Mapping):
                checkpoint, unwrapped = checkpoint[key], True
    tensors = {k: v for k, v in checkpoint.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise CheckpointMismatchError(
            f"checkpoint {source} holds no tensors at its top level or under {_WRAPPER_KEYS}; "
            f"its keys are {sorted(checkpoint)[:10]}"
        )
    return tensors


def _key_style(state: Mapping[str, torch.Tensor]) -> str:
    if any(key.removeprefix(_DDP_PREFIX).startswith("patch_embed1.") for key in state):
        return "official"
    if any(".attn.kv." in key for key in state):
        return "timm (fused kv)"
    return "split q/k/v"


def _preview(keys: list[str], limit: int = 12) -> str:
    more = f" ... (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return f"{keys[:limit]}{more}"


def load_pretrained(
    model: PvtV2Encoder, source: str | Path | Mapping[str, Any], strict: bool = True
) -> LoadReport:
    """Load official, timm or our own PVTv2 weights into ``model`` (:func:`checkpoint_filter_fn`).

    ``source`` is a .pth/.pt/.bin/.safetensors file or an already loaded state dict. Shape
    mismatches always raise. With ``strict`` any missing encoder key or unexpected key (e.g. the
    extra blocks of a deeper variant) raises :class:`CheckpointMismatchError`; the head is dropped.
    """
    if isinstance(source, Mapping):
        name, checkpoint = "<state dict>", source
    else:
        name, checkpoint = str(source), read_state_dict(source)
    raw = _unwrap(checkpoint, name)
    key_style = _key_style(raw)
    state, dropped = checkpoint_filter_fn(raw)

    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    mismatched = [
        f"{key}: checkpoint {tuple(state[key].shape)} vs model {tuple(own[key].shape)}"
        for key in sorted(set(own) & set(state))
        if state[key].shape != own[key].shape
    ]
    variant = model.variant or "this encoder"
    if mismatched:
        raise CheckpointMismatchError(
            f"checkpoint {name} does not fit {variant} (wrong variant?): shape mismatch for "
            f"{_preview(mismatched)}"
        )
    if strict and (missing or unexpected):
        raise CheckpointMismatchError(
            f"checkpoint {name} ({key_style} keys) does not fit {variant}: missing encoder keys "
            f"{_preview(missing)}; unexpected keys {_preview(unexpected)}. Use the checkpoint of "
            f"the same variant, or load_pretrained(..., strict=False) to accept a partial load"
        )
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    report = LoadReport(
        source=name,
        key_style=key_style,
        loaded=len(set(own) & set(state)),
        missing=missing,
        unexpected=unexpected,
        dropped_head=dropped,
    )
    _logger.info(
        "loaded %d/%d tensors into %s from %s (%s keys); dropped head %s",
        report.loaded,
        len(own),
        variant,
        name,
        key_style,
        dropped,
    )
    if missing or unexpected:
        _logger.warning(
            "partial load from %s: missing %s; unexpected %s",
            name,
            _preview(missing),
            _preview(unexpected),
        )
    return report


def create_pvt_v2(
    variant: str,
    pretrained: bool | str | Path = False,
    weights_dir: str | Path | None = None,
    drop_path_rate: float = DEFAULT_DROP_PATH_RATE,
    **kwargs: Any,
) -> PvtV2Encoder:
    """Encoder ``variant`` (one of ``PVT_V2_VARIANTS``) built by timm's factory, attention split.

    ``pretrained``: False = random init (timm's init); True = search weights (see
    ``models.pvt.weights.resolve_pretrained``); a path = that file. ``kwargs`` go to timm's
    model (e.g. ``attn_drop_rate``).
    """
    if variant not in PVT_V2_VARIANTS:
        raise ValueError(f"unknown PVTv2 variant '{variant}'; choose one of {PVT_V2_VARIANTS}")
    backbone = timm.create_model(
        variant, pretrained=False, num_classes=0, drop_path_rate=drop_path_rate, **kwargs
    )
    model = PvtV2Encoder(backbone)
    if pretrained is not False:
        load_pretrained(model, resolve_pretrained(variant, pretrained, weights_dir), strict=True)
    return model


def pvt_v2_b0(pretrained: bool | str | Path = False, **kwargs: Any) -> PvtV2Encoder:
    """PVTv2-b0 encoder (the FedST / FedDP / PFedSIS default)."""
    return create_pvt_v2("pvt_v2_b0", pretrained=pretrained, **kwargs)


def pvt_v2_b1(pretrained: bool | str | Path = False, **kwargs: Any) -> PvtV2Encoder:
    """PVTv2-b1 encoder."""
    return create_pvt_v2("pvt_v2_b1", pretrained=pretrained, **kwargs)


def pvt_v2_b2(pretrained: bool | str | Path = False, **kwargs: Any) -> PvtV2Encoder:
    """PVTv2-b2 encoder."""
    return create_pvt_v2("pvt_v2_b2", pretrained=pretrained, **kwargs)


def pvt_v2_b3(pretrained: bool | str | Path = False, **kwargs: Any) -> PvtV2Encoder:
    """PVTv2-b3 encoder."""
    return create_pvt_v2("pvt_v2_b3", pretrained=pretrained, **kwargs)


def pvt_v2_b4(pretrained: bool | str | Path = False, **kwargs: Any) -> PvtV2Encoder:
    """PVTv2-b4 encoder."""
    return create_pvt_v2("pvt_v2_b4", pretrained=pretrained, **kwargs)


def pvt_v2_b5(pretrained: bool | str | Path = False, **kwargs: Any) -> PvtV2Encoder:
    """PVTv2-b5 encoder."""
    return create_pvt_v2("pvt_v2_b5", pretrained=pretrained, **kwargs)


def pvt_v2_b2_li(pretrained: bool | str | Path = False, **kwargs: Any) -> PvtV2Encoder:
    """PVTv2-b2 encoder with linear spatial-reduction attention (7x7 pooled keys/values)."""
    return create_pvt_v2("pvt_v2_b2_li", pretrained=pretrained, **kwargs)

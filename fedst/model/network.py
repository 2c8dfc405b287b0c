"""The FedST segmentation network (paper Sec. III-B, Fig. 2) and its streaming inference.

``network.temporal_placement="decode_head"`` (CFFM's placement and the default since issue 58,
fedst/model/temporal_head.py): clip [B, T, 3, H, W] -> every clip frame through the PVTv2
encoder, the textual-guided channel selection (Eq. 7-8) or, for the Table IV "prompt without CS"
ablation, an indicator bias, and the FPN decoder's fused map, in one batched pass -> the temporal
block (Eq. 3-4) on the T fused maps at 1/8 -> a second classifier on the current frame's map
before and after it -> logits [B, num_classes, H, W] of the current (last) frame. Channel
selection acts on each frame's encoder features (TS does not feed it).

``network.temporal_placement="encoder"`` (the paper's order, the default until issue 58): clip ->
PVTv2 encoder on all frames (batched) -> for each temporal stage the temporal cross-attention over
the T frames (F_t -> F*_t) -> for each CS stage channel selection (F*_t -> F'_t) or the indicator
bias -> FPN decoder -> logits of the current frame.

Module names are stable because parameter partition rules (``fedst.model.partition``) match them:
``encoder.*`` (PVTv2, ``attn.q`` / ``attn.k`` / ``attn.v``), ``temporal.<stage>.*``,
``channel_selection.<stage>.*``, ``prompt.<stage>.*``, ``decoder.*`` (``blocks.<i>.attn.q``);
the decode-head placement's ``temporal.decode_head.block.*`` and ``temporal.decode_head.classifier.*``.

Streaming (:meth:`FedSTNet.stream`): each new frame costs one encoder pass, the temporal module and
the decoder; the earlier frames' features of the temporal stages are cached (in the decode-head
placement, their fused decoder maps). Earlier frames are
chosen by time with the rule of the clip datasets (``fedst.data.clips.clip_frame_positions``,
streamed by :class:`fedst.data.clips.FrameHistory`): frame k steps back is the latest earlier frame
at or before ``t - k * interval_s``; before the video's first frame the current frame is used. So a
stream of a video's frames gives the clip dataset's predictions while encoding each frame once.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from fedst.data.clips import FrameHistory
from fedst.model.channel_selection import ChannelSelection, PromptBias, SiteChannelSelection
from fedst.model.decoder import FPNDecoder
from fedst.model.temporal import TemporalCrossAttention
from fedst.model.temporal_cffm import CFFMTemporalBlock
from fedst.model.temporal_head import DECODE_HEAD, TemporalDecodeHead
from fedst.schema.network import (
    TEMPORAL_VARIANTS,
    NetworkConfig,
)

__all__ = [
    "TEMPORAL_VARIANTS",
    "FedSTNet",
    "NetworkConfig",
    "StreamingState",
    "build_network",
    "build_temporal_module",
    "stage_map_size",
]

log = logging.getLogger(__name__)

CHANNEL_SELECTIONS = {"fedst": ChannelSelection, "feddp": SiteChannelSelection}
"""``NetworkConfig.channel_selection_kind`` -> the module built at each CS stage."""
TEMPORAL_HEAD_DIM = 32


class FedSTNet(nn.Module):
    """Encoder + temporal module + channel selection + decoder (Fig. 2, local side)."""

    def __init__(self, cfg: NetworkConfig, encoder: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.encoder = encoder
        if cfg.encoder_grad_checkpointing:  # a module starts in training mode (see train())
            encoder.set_grad_checkpointing(True)
        dims = tuple(encoder.embed_dims)
        self.temporal = nn.ModuleDict()
        if cfg.temporal and cfg.temporal_placement == DECODE_HEAD:
            block = build_temporal_module(cfg, cfg.decoder_dim)
            self.temporal[DECODE_HEAD] = TemporalDecodeHead(block, cfg.num_classes)
        elif cfg.temporal:
            for s in cfg.temporal_stages:
                self.temporal[str(s)] = build_temporal_module(cfg, dims[s])
        self.channel_selection = nn.ModuleDict()
        self.prompt = nn.ModuleDict()
        for s in cfg.cs_stages if cfg.prompt else ():
            if cfg.channel_selection:
                selection = CHANNEL_SELECTIONS[cfg.channel_selection_kind]
                self.channel_selection[str(s)] = selection(dims[s], cfg.indicator_dim)
            else:
                self.prompt[str(s)] = PromptBias(dims[s], cfg.indicator_dim)
        self.decoder = FPNDecoder(dims, num_classes=cfg.num_classes, decoder_dim=cfg.decoder_dim)

    def train(self, mode: bool = True) -> FedSTNet:
        """nn.Module.train, which also switches the encoder's gradient checkpointing
        (``cfg.encoder_grad_checkpointing``) on in training mode only: inference never recomputes."""
        super().train(mode)
        if self.cfg.encoder_grad_checkpointing:
            self.encoder.set_grad_checkpointing(mode)
        return self

    def prepare_temporal(self, image_size: tuple[int, int]) -> None:
        """Build the temporal modules' layouts for ``image_size`` [H, W] clips eagerly, so that
        ``torch.compile`` of this model traces no index arithmetic (call before compiling)."""
        for key, module in self.temporal.items():
            if isinstance(module, TemporalDecodeHead):  # the decoder's fused map: stage 0's size
                module.prepare(stage_map_size(image_size, 0))
            elif isinstance(module, CFFMTemporalBlock):
                module.prepare(*stage_map_size(image_size, int(key)))

    @property
    def prediction_head(self) -> nn.Conv2d:
        """The 1x1 classifier that gives a clip's logits (GEN-Guard's W_CONV, b_CONV): CFFM's
        ``linear_pred2`` (``temporal.decode_head.classifier``, input [B, 2 D, h/2, w/2]) in the
        decode-head placement, else the decoder's head (input [B, D, h, w])."""
        if DECODE_HEAD in self.temporal:
            return self.temporal[DECODE_HEAD].classifier
        return self.decoder.head

    @property
    def cache_keys(self) -> tuple[int | str, ...]:
        """What a streamed frame leaves in the feature cache (:meth:`cached_maps`):
        ``("decode_head",)`` in the decode-head placement, else the temporal stages."""
        if self.cfg.temporal_placement == DECODE_HEAD:
            return (DECODE_HEAD,)
        return tuple(self.cfg.temporal_stages)

    def cached_maps(
        self, feats: list[torch.Tensor], indicator: torch.Tensor | None
    ) -> dict[int | str, torch.Tensor]:
        """A frame's entries of the feature cache, from its 4 encoder maps [N, C_i, h_i, w_i]:
        the fused decoder map [N, D, h_0, w_0] (CS / prompt applied; decode-head placement), or
        each temporal stage's map. Streaming (:class:`StreamingState`) and the exported step
        (fedst/export.py) keep the same entries."""
        if self.cfg.temporal_placement == DECODE_HEAD:
            return {DECODE_HEAD: self.decoder_maps(list(feats), indicator)}
        return {s: feats[s] for s in self.cfg.temporal_stages}

    @property
    def needs_indicator(self) -> bool:
        """True when the forward pass uses the site indicator (prompt or CS on)."""
        return self.cfg.prompt

    def uses_temporal(self, num_frames: int, use_temporal: bool = True) -> bool:
        """Whether a clip of ``num_frames`` frames goes through the temporal module."""
        if not (self.cfg.temporal and use_temporal and num_frames > 1):
            return False
        if num_frames != self.cfg.num_frames:
            raise ValueError(
                f"FedSTNet: clip has T={num_frames} frames but the temporal module takes "
                f"{self.cfg.num_frames} (len(receptive_fields)); build clips of that length"
            )
        return True

    def forward(
        self,
        clip: torch.Tensor,
        indicator: torch.Tensor | None = None,
        *,
        use_temporal: bool = True,
        return_features: bool = False,
        return_frame_logits: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """clip [B, T, 3, H, W] (oldest first), indicator [D] | [B, D] -> logits [B, K, H, W].

        With ``return_features`` also returns the encoder's 4 maps of the current frame (before
        the temporal module and CS); with ``return_frame_logits`` also every clip frame's own
        prediction [B, T, K, H, W] (CFFM's per-frame predictions, for
        ``train.clip_frame_loss_weight``), in that order after the logits: in the decode-head
        placement the decoder's head on each frame (CFFM's ``linear_pred``), in the encoder
        placement the decoder on each frame's encoder maps without the temporal module
        (:meth:`_frame_logits`; there only where the temporal module runs, a ValueError
        otherwise). Earlier frames are only encoded when the temporal module runs or frame
        logits are asked for.
        """
        if clip.dim() != 5:
            raise ValueError(f"FedSTNet expects clips [B, T, 3, H, W], got {tuple(clip.shape)}")
        self._check_indicator(indicator)
        num_frames = clip.shape[1]
        out_size = (clip.shape[3], clip.shape[4])
        temporal = self.uses_temporal(num_frames, use_temporal)
        if self.cfg.temporal_placement == DECODE_HEAD:
            logits, feats, frame_logits = self._forward_decode_head(
                clip, indicator, temporal, return_frame_logits
            )
            extra = ([feats] if return_features else []) + (
                [frame_logits] if return_frame_logits else []
            )
            return (logits, *extra) if extra else logits
        if return_frame_logits and not temporal:
            raise ValueError(
                f"FedSTNet: return_frame_logits needs the temporal module on clips of "
                f"{self.cfg.num_frames} frames (temporal={self.cfg.temporal}, use_temporal="
                f"{use_temporal}, T={num_frames}); a single-frame network predicts the current "
                f"frame only"
            )
        history: dict[int | str, list[torch.Tensor]] = {}
        if temporal:
            per_frame = self._encode_clip(clip)  # 4 x [B, T, C_i, h_i, w_i]
            feats = [f[:, -1] for f in per_frame]  # 4 x [B, C_i, h_i, w_i]
            history = {
                s: [per_frame[s][:, t] for t in range(num_frames)] for s in self.cfg.temporal_stages
            }
        else:
            feats = self.encoder(clip[:, -1])  # [B, 3, H, W] -> 4 x [B, C_i, h_i, w_i]
        logits = self._decode(feats, history, indicator, out_size)
        outputs = (logits, *([feats] if return_features else []))
        if return_frame_logits:
            outputs += (self._frame_logits(per_frame, indicator, out_size),)
        return outputs if len(outputs) > 1 else logits

    def encoder_features(self, clip: torch.Tensor, stage: int) -> torch.Tensor:
        """clip [B, T, 3, H, W] -> the current frame's encoder map at ``stage`` [B, C_s, h_s, w_s]:
        ``forward(clip, use_temporal=False, return_features=True)[1][stage]`` without the later
        encoder stages and the decoder (SERQ's passes that only read F)."""
        if clip.dim() != 5:
            raise ValueError(f"FedSTNet expects clips [B, T, 3, H, W], got {tuple(clip.shape)}")
        return self.encoder(clip[:, -1], num_stages=stage + 1)[stage]

    def _encode_clip(self, clip: torch.Tensor) -> list[torch.Tensor]:
        """[B, T, 3, H, W] -> 4 maps [B, T, C_i, h_i, w_i] (one batched encoder pass)."""
        batch, num_frames = clip.shape[:2]
        if self.cfg.detach_previous_frames and torch.is_grad_enabled():
            with torch.no_grad():
                earlier = self.encoder(clip[:, :-1].flatten(0, 1))  # -> 4 x [B*(T-1), C, h, w]
            current = self.encoder(clip[:, -1])  # 4 x [B, C, h, w]
            return [
                torch.cat([e.unflatten(0, (batch, num_frames - 1)), c.unsqueeze(1)], dim=1)
                for e, c in zip(earlier, current, strict=True)
            ]
        feats = self.encoder(clip.flatten(0, 1))  # [B*T, 3, H, W] -> 4 x [B*T, C, h, w]
        return [f.unflatten(0, (batch, num_frames)) for f in feats]  # -> [B, T, C, h, w]

    def _forward_decode_head(
        self,
        clip: torch.Tensor,
        indicator: torch.Tensor | None,
        temporal: bool,
        return_frame_logits: bool,
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
        """Decode-head placement: clip [B, T, 3, H, W] -> (logits [B, K, H, W], the current
        frame's 4 encoder maps, frame logits [B, T, K, H, W] or None). Every frame through the
        encoder, CS and the decoder's fused map in one batched pass over B*T frames."""
        batch, num_frames = clip.shape[:2]
        out_size = (clip.shape[3], clip.shape[4])
        if not (temporal or return_frame_logits):
            feats = self.encoder(clip[:, -1])  # the single-frame network
            return self._decode(feats, {}, indicator, out_size), feats, None
        per_frame = self._encode_clip(clip)  # 4 x [B, T, C_i, h_i, w_i]
        frame_indicator = per_frame_indicator(indicator, num_frames)
        fused = self.decoder_maps([f.flatten(0, 1) for f in per_frame], frame_indicator)
        frame_logits = None
        if return_frame_logits:  # [B*T, D, h, w] -> [B, T, K, H, W]
            frame_logits = self.decoder.predict(fused, out_size).unflatten(0, (batch, num_frames))
        fused = fused.unflatten(0, (batch, num_frames))  # [B, T, D, h, w]
        feats = [f[:, -1] for f in per_frame]
        if temporal:
            logits = self._decode(feats, {DECODE_HEAD: list(fused.unbind(1))}, indicator, out_size)
        else:
            logits = frame_logits[:, -1]
        return logits, feats, frame_logits

    def decoder_maps(
        self, feats: list[torch.Tensor], indicator: torch.Tensor | None
    ) -> torch.Tensor:
        """4 encoder maps [N, C_i, h_i, w_i] -> CS / prompt (F -> F') -> the map the decoder's head
        reads [N, D, h_0, w_0] (the decode-head placement's per-frame map, CFFM's ``_c``)."""
        return self.decoder.fused_map(self._select_channels(list(feats), indicator))

    def _select_channels(
        self, feats: list[torch.Tensor], indicator: torch.Tensor | None
    ) -> list[torch.Tensor]:
        for name, module in [*self.channel_selection.items(), *self.prompt.items()]:
            feats[int(name)] = module(feats[int(name)], indicator)
        return feats

    def _frame_logits(
        self,
        per_frame: list[torch.Tensor],
        indicator: torch.Tensor | None,
        out_size: tuple[int, int],
    ) -> torch.Tensor:
        """Every clip frame's own prediction (CFFM's per-frame logits): the encoder maps of the
        clip's batched pass, 4 x [B, T, C_i, h_i, w_i], through CS / prompt (the site's indicator,
        as on the current frame's path) and the decoder, without the temporal module ->
        [B, T, K, H, W]."""
        batch, num_frames = per_frame[0].shape[:2]
        frames = [f.flatten(0, 1) for f in per_frame]  # 4 x [B*T, C_i, h_i, w_i]
        logits = self._decode(frames, {}, per_frame_indicator(indicator, num_frames), out_size)
        return logits.unflatten(0, (batch, num_frames))

    def _decode(
        self,
        feats: list[torch.Tensor],
        history: dict[int | str, list[torch.Tensor]],
        indicator: torch.Tensor | None,
        out_size: tuple[int, int],
    ) -> torch.Tensor:
        """Temporal module (F -> F*), CS / prompt (F* -> F'), decoder -> [B, K, H, W]. In the
        decode-head placement ``history[DECODE_HEAD]`` holds the T frames' fused decoder maps
        [B, D, h, w] (:meth:`decoder_maps`, current last) and ``feats`` is not read."""
        if DECODE_HEAD in history:
            logits = self.temporal[DECODE_HEAD](torch.stack(history[DECODE_HEAD], dim=1))
            return F.interpolate(logits, size=out_size, mode="bilinear")  # -> [B, K, H, W]
        enhanced = list(feats)
        for s, frames in history.items():
            enhanced[s] = self.temporal[str(s)](frames)  # T x [B, C, h, w] -> [B, C, h, w]
        return self.decoder(self._select_channels(enhanced, indicator), out_size)

    def _check_indicator(self, indicator: torch.Tensor | None) -> None:
        if not self.needs_indicator:
            return
        if indicator is None:
            raise ValueError(
                "FedSTNet: prompt/channel selection is on, so a site indicator [D] or [B, D] is "
                "required; pass indicator=site_indicators(...)[site]"
            )
        if indicator.shape[-1] != self.cfg.indicator_dim:
            raise ValueError(
                f"FedSTNet: indicator has dim {indicator.shape[-1]}, config indicator_dim is "
                f"{self.cfg.indicator_dim}"
            )

    def stream(
        self,
        indicator: torch.Tensor | None,
        frame_stride: int = 1,
        *,
        interval_s: float | None = None,
        use_temporal: bool = True,
    ) -> StreamingState:
        """Start streaming inference over one video.

        With ``interval_s`` each step passes the frame's time in seconds and the clip frames are
        ``interval_s`` apart in time (a video at its own frame rate); without it the clip frames
        are ``frame_stride`` frames apart. ``use_temporal=False`` is the single-frame network, as
        ``forward(..., use_temporal=False)``.
        """
        return StreamingState(self, indicator, frame_stride, interval_s, use_temporal)


class StreamingState:
    """Frame-by-frame inference that caches the temporal stages' features of earlier frames.

    ``step(frame [B, 3, H, W], time_s) -> logits [B, K, H, W]`` equals ``net(clip)`` on the clip
    whose earlier frames :class:`~fedst.data.clips.FrameHistory` picks from the frames stepped so
    far (the frames 0.2 s apart, say, or ``k * frame_stride`` frames back without times). Runs
    without gradient; call ``net.eval()`` first for deterministic output.
    """

    def __init__(
        self,
        net: FedSTNet,
        indicator: torch.Tensor | None,
        frame_stride: int = 1,
        interval_s: float | None = None,
        use_temporal: bool = True,
    ):
        if frame_stride < 1:
            raise ValueError(f"StreamingState: frame_stride must be >= 1, got {frame_stride}")
        net._check_indicator(indicator)
        self.net = net
        self.indicator = indicator
        self.timed = interval_s is not None
        self.temporal = net.uses_temporal(net.cfg.num_frames, use_temporal)
        self._history = FrameHistory(
            net.cfg.num_frames, interval_s if interval_s is not None else float(frame_stride)
        )
        self._frames_seen = 0

    def reset(self) -> None:
        """Forget earlier frames (start of a new video)."""
        self._history.reset()
        self._frames_seen = 0

    @torch.no_grad()
    def step(
        self, frame: torch.Tensor, time_s: float | None = None, *, predict: bool = True
    ) -> torch.Tensor | None:
        """frame [B, 3, H, W] at ``time_s`` -> logits [B, K, H, W] of this frame.

        ``predict=False`` only adds the frame to the history (a context frame nobody needs a
        prediction for) and returns None; without the temporal module it does nothing.
        """
        if frame.dim() != 4:
            raise ValueError(f"StreamingState.step expects [B, 3, H, W], got {tuple(frame.shape)}")
        if self.timed == (time_s is None):
            raise ValueError(
                "StreamingState.step: pass time_s exactly when the stream was started with "
                "interval_s (net.stream(indicator, interval_s=...))"
            )
        time = float(time_s) if time_s is not None else float(self._frames_seen)
        self._frames_seen += 1
        if not (predict or self.temporal):
            return None
        feats = self.net.encoder(frame)  # 4 x [B, C_i, h_i, w_i]
        history = (
            self._advance(time, self.net.cached_maps(feats, self.indicator))
            if self.temporal
            else {}
        )
        if not predict:
            return None
        return self.net._decode(feats, history, self.indicator, (frame.shape[2], frame.shape[3]))

    @torch.no_grad()
    def step_frames(
        self,
        frames: torch.Tensor,
        times_s: list[float] | None = None,
        predict: list[bool] | None = None,
    ) -> torch.Tensor | None:
        """N consecutive frames of this stream's video, in time order: frames [N, 3, H, W] at
        ``times_s`` -> logits [M, K, H, W] of the M frames with ``predict`` true (None if M = 0).

        Equals N calls of :meth:`step` on [1, 3, H, W] frames (to float rounding), with one
        batched encoder pass over the frames it needs and one batched decoder pass over the
        predicted ones. ``predict`` defaults to every frame.
        """
        if frames.dim() != 4:
            raise ValueError(
                f"StreamingState.step_frames expects [N, 3, H, W], got {tuple(frames.shape)}"
            )
        count = frames.shape[0]
        predict = [True] * count if predict is None else list(predict)
        if self.timed == (times_s is None) or len(predict) != count:
            raise ValueError(
                "StreamingState.step_frames: pass one time per frame exactly when the stream was "
                f"started with interval_s, and one predict flag per frame (got {count} frames, "
                f"times {times_s}, predict {predict})"
            )
        if times_s is None:
            times = [float(self._frames_seen + i) for i in range(count)]
        else:
            times = [float(t) for t in times_s]
        self._frames_seen += count
        encoded = [i for i in range(count) if predict[i] or self.temporal]
        if not encoded:
            return None
        feats = self.net.encoder(frames if len(encoded) == count else frames[encoded])
        # the feature cache's entries in one batched pass over the rows
        cached = self.net.cached_maps(feats, self.indicator) if self.temporal else {}
        predicted, histories = [], []  # rows of feats, and their temporal context
        for row, i in enumerate(encoded):
            own = {key: value[row : row + 1] for key, value in cached.items()}
            history = self._advance(times[i], own) if self.temporal else {}
            if predict[i]:
                predicted.append(row)
                histories.append(history)
        if not predicted:
            return None
        if len(predicted) != len(encoded):
            feats = [f[predicted] for f in feats]  # 4 x [M, C_i, h_i, w_i]
        stacked = {  # stage (or DECODE_HEAD) -> T x [M, C, h, w]
            s: [torch.cat([h[s][t] for h in histories]) for t in range(self.net.cfg.num_frames)]
            for s in (self.net.cache_keys if self.temporal else ())
        }
        return self.net._decode(feats, stacked, self.indicator, (frames.shape[2], frames.shape[3]))

    def _advance(
        self, time: float, own: dict[int | str, torch.Tensor]
    ) -> dict[int | str, list[torch.Tensor]]:
        """Add a frame's cached maps (``own``: :meth:`FedSTNet.cached_maps`) to the history;
        return its clip's maps per key, T x [B, C, h, w], oldest first."""
        earlier = self._history.context(time)  # T-1 x ({key: [B, C, h, w]} | None)
        self._history.append(time, own)
        return {k: [own[k] if e is None else e[k] for e in earlier] + [own[k]] for k in own}


def per_frame_indicator(indicator: torch.Tensor | None, num_frames: int) -> torch.Tensor | None:
    """A clip batch's site indicator for its B*T frames flattened batch-major: [B, D] ->
    [B*T, D]; a shared [D] (or None) is returned as it is."""
    if indicator is not None and indicator.dim() == 2:
        return indicator.repeat_interleave(num_frames, dim=0)
    return indicator


def build_temporal_module(cfg: NetworkConfig, dim: int) -> nn.Module:
    """The temporal module of ``cfg.temporal_variant`` for a stage of ``dim`` channels."""
    shape = {"num_heads": max(1, dim // TEMPORAL_HEAD_DIM), "window_size": cfg.window_size}
    if cfg.temporal_variant == "windowed":
        return TemporalCrossAttention(
            dim, **shape, receptive_fields=cfg.receptive_fields, pool_sizes=cfg.pool_sizes
        )
    return CFFMTemporalBlock(
        dim,
        **shape,
        tokens_per_window=cfg.temporal_tokens_per_window,
        context_tokens=cfg.temporal_context_tokens,
        target_ring=cfg.temporal_target_ring,
        target_pooled=cfg.temporal_target_pooled,
        mlp_ratio=cfg.temporal_mlp_ratio,
        alignment=cfg.temporal_alignment,
        position_bias=cfg.temporal_position_bias,
    )


def stage_map_size(image_size: tuple[int, int], stage: int) -> tuple[int, int]:
    """[H, W] input -> the PVTv2 encoder's map size at ``stage`` (0-based): its patch embeddings
    are convolutions of stride 4 (kernel 7, padding 3) then 2 (kernel 3, padding 1), each giving
    ``ceil(size / stride)``."""
    height, width = image_size
    for stride in (4, 2, 2, 2)[: stage + 1]:
        height, width = math.ceil(height / stride), math.ceil(width / stride)
    return height, width


def build_network(cfg: NetworkConfig) -> FedSTNet:
    """FedSTNet with a PVTv2 encoder built (and, if asked, loaded) by ``models.pvt``."""
    from models.pvt import create_pvt_v2

    encoder = create_pvt_v2(
        cfg.encoder,
        pretrained=cfg.pretrained,
        weights_dir=cfg.weights_dir,
        drop_path_rate=cfg.drop_path_rate,
    )
    net = FedSTNet(cfg, encoder)
    log.info(
        "built FedSTNet (%s, temporal=%s %s, prompt=%s, cs=%s %s): %d parameters",
        cfg.encoder,
        cfg.temporal,
        "decode_head" if cfg.temporal_placement == DECODE_HEAD else cfg.temporal_stages,
        cfg.prompt,
        cfg.channel_selection,
        cfg.cs_stages,
        sum(p.numel() for p in net.parameters()),
    )
    return net

"""The architecture a config names, without torch: :class:`NetworkConfig` (``network.*``, built
by fedst/model/network.py) and the names its fields accept."""

from __future__ import annotations

from dataclasses import dataclass, field

from fedst.schema.roles import RESOURCE, role

ENCODERS = (*(f"pvt_v2_b{size}" for size in range(6)), "pvt_v2_b2_li")
"""``NetworkConfig.encoder``: the PVTv2 variants models/pvt builds (its PVT_V2_VARIANTS, which
tests/test_config_floor.py ties to this list), checked here without torch or timm."""
NUM_STAGES = 4
"""Encoder stages of PVTv2 (0-based indices 0..3 in ``temporal_stages`` and ``cs_stages``)."""
ALIGNMENTS = ("centred", "reference")
POSITION_BIASES = ("reference", "free")
"""``temporal_alignment`` and ``temporal_position_bias`` of the "cffm" module
(fedst/model/temporal_cffm.py)."""
CHANNEL_SELECTION_KINDS = ("fedst", "feddp")
"""``NetworkConfig.channel_selection_kind``: the module built at each CS stage
(fedst/model/network.py CHANNEL_SELECTIONS)."""
TEMPORAL_VARIANTS = ("cffm", "windowed")
"""``NetworkConfig.temporal_variant``: "cffm" = CFFM's block (fedst/model/temporal_cffm.py, the
default since issue 58), "windowed" = the module of issues 1-47 (fedst/model/temporal.py: r and p
on the raw grid, ``Linear(C p^2, C)`` pooling, one free bias table, no norm or MLP)."""
TEMPORAL_PLACEMENTS = ("encoder", "decode_head")
"""``NetworkConfig.temporal_placement``: "decode_head" = CFFM's (fedst/model/temporal_head.py, the
default since issue 58); "encoder" = after encoder stage ``temporal_stages``, before the decoder
(the default until then)."""


@dataclass(frozen=True)
class NetworkConfig:
    """Architecture of one FedST site model. Defaults: the full FedST network on PVTv2-b0."""

    # PVTv2 variant of the encoder: pvt_v2_b0 (paper, FedDP) ... pvt_v2_b5.
    encoder: str = "pvt_v2_b0"
    # ImageNet weights: False = random init (demo only), True = search weights_dir / hub, or a path.
    pretrained: bool | str = False
    # Directory searched for encoder checkpoints when pretrained is True.
    weights_dir: str | None = None
    # Stochastic depth rate of the encoder (FedDP / PFedSIS: 0.1).
    drop_path_rate: float = 0.1
    # Output classes: 0 background, 1 shaft, 2 wrist, 3 jaw.
    num_classes: int = 4
    # Channels of the FPN decoder (maps at 1/4 resolution).
    decoder_dim: int = 128
    # Table IV "TS": temporal cross-attention over the clip (Eq. 3-4).
    temporal: bool = True
    # 0-based encoder stages that get a temporal module. Default (1,) (stride 8, 64 channels):
    # measured at 512x640 on CPU it costs ~37 ms CPU per frame (~2 % of encoder + decoder), about
    # the same as stage 3 (~29 ms), but has 0.31 M parameters instead of 4.84 M (the Eq. 3 pooling
    # FC of stage 3 is Linear(256*49, 256)), so the shared upload stays near FedAvg's; and r = 49
    # cells at stride 8 (392 px) is a plausible instrument-motion range, at stride 32 it exceeds
    # the frame. Measured with bench/model.py and bench/temporal.py.
    temporal_stages: tuple[int, ...] = (1,)
    # Window size s of the temporal module (Sec. III-B1).
    window_size: int = 7
    # Receptive field r per frame, oldest first; its length is the clip length T. The "windowed"
    # variant reads r and p as cells of the stage map; "cffm" as r = p x k (CFFM's 49, 17.5, 7).
    receptive_fields: tuple[int, ...] = (49, 20, 6, 7)
    # Pooling size p per frame, oldest first (Eq. 3).
    pool_sizes: tuple[int, ...] = (7, 4, 2, 1)
    # Which temporal module: "cffm" (CFFM's cross-frame block, the paper's reference code) |
    # "windowed" (the module of issues 1-47, kept so that earlier results stay comparable).
    temporal_variant: str = "cffm"
    # cffm: pooled tokens l per window side of each earlier frame, oldest first (CFFM: 1, 2, 3,
    # i.e. p = 7, 3.5, 2.33 cells); one entry per earlier frame (len(receptive_fields) - 1).
    temporal_tokens_per_window: tuple[int, ...] = (1, 2, 3)
    # cffm: context tokens k per side of each earlier frame, oldest first (CFFM: 7, 5, 3; r = p k).
    temporal_context_tokens: tuple[int, ...] = (7, 5, 3)
    # cffm: which k tokens a window takes: "centred" on the window (ours; every cell of the window
    # has its own t-1 token) | "reference" (CFFM's unfold: the last 2.33 cells of t-1 uncovered).
    temporal_alignment: str = "centred"
    # cffm: B as CFFM's relative tables ("reference") or one value per query cell and slot ("free").
    temporal_position_bias: str = "reference"
    # cffm: ring of the current frame's cells around each window (CFFM's expand_size 3; 0: none).
    temporal_target_ring: int = 3
    # cffm: window-pooled tokens of the current frame per side (CFFM's focal_window 5; 0: none).
    temporal_target_pooled: int = 5
    # cffm: MLP after the attention, hidden = ratio x C (CFFM: 4; 0: none).
    temporal_mlp_ratio: float = 4.0
    # Where the temporal module sits (docs/design-notes.md, "The temporal module against CFFM",
    # row 10). "decode_head" (default; CFFM's, as DESIGN.md asks): every clip frame through the
    # decoder, the fused maps (after the decoder's block) at 1/8 through the "cffm" block, a
    # second classifier on [before, after] (fedst/model/temporal_head.py); there TS no longer
    # feeds CS (CS acts on each frame's encoder features F) and temporal_stages only names SERQ's
    # F (temporal_stages[0], unless serq.feature_stage), still an encoder stage. It is the
    # placement whose positive control reads the clip's past (48.09 Dice over 3 seeds against
    # 18.29 for "encoder"; studies/temporal_cffm/README.md, section 4). "encoder" = on encoder
    # stage ``temporal_stages``, before CS and the decoder, the order of the paper's text
    # (Sec. III-B: F -> TS -> F* -> CS -> F' -> decoder); the default until issue 58.
    temporal_placement: str = "decode_head"
    # Table IV "Prompt": use the site indicator. Alone (channel_selection False) it adds a
    # per-channel bias Linear(xi) at cs_stages; with channel_selection it feeds the CS network.
    prompt: bool = True
    # Table IV "CS": textual-guided channel selection (Eq. 7-8); requires prompt.
    channel_selection: bool = True
    # Which channel-selection network: "fedst" (Eq. 7-8, ChannelSelection) | "feddp" (the FedDP
    # baseline's SiteChannelSelection: average and max pooling, embedded site vector). The FedDP
    # method sets "feddp" itself, and its stages from method.options.channel_selection_stages.
    channel_selection_kind: str = "fedst"
    # 0-based encoder stages whose features get CS / the prompt bias. Default: stage 1, the
    # encoder placement's temporal stage, where Eq. 7-8 act on the temporal module's output F*
    # (with temporal_placement="decode_head", the default, CS acts on every frame's encoder
    # features F at this stage, before the decoder and the temporal block).
    cs_stages: tuple[int, ...] = (1,)
    # Dimension of the site indicator xi (512 for CLIP ViT-B-32).
    indicator_dim: int = 512
    # Encode the earlier frames of a clip without gradient (saves CPU time; not in the paper).
    detach_previous_frames: bool = False
    # Recompute the encoder blocks' activations in the backward pass instead of keeping them
    # (timm's gradient checkpointing): the same gradients, less memory for more compute. At
    # 512x640 with 4-frame clips of batch 2 it cut one step's peak memory on the CPU by about
    # 1.6 GB (docs/paper-scale.md).
    encoder_grad_checkpointing: bool = field(default=False, metadata=role(RESOURCE))

    def __post_init__(self) -> None:
        if self.encoder not in ENCODERS:
            raise ValueError(f"network.encoder={self.encoder!r}; choose one of {ENCODERS}")
        for name in ("temporal_stages", "cs_stages"):
            stages = getattr(self, name)
            if len(set(stages)) != len(stages) or any(not 0 <= s < NUM_STAGES for s in stages):
                raise ValueError(
                    f"NetworkConfig.{name} must hold distinct stage indices in 0..3, got {stages}"
                )
        if self.temporal and not self.temporal_stages:
            raise ValueError("NetworkConfig: temporal is on but temporal_stages is empty")
        if self.channel_selection and not self.prompt:
            raise ValueError(
                "NetworkConfig: channel_selection=True needs prompt=True (the CS network is driven "
                "by the site indicator); set prompt: true or channel_selection: false"
            )
        if self.channel_selection_kind not in CHANNEL_SELECTION_KINDS:
            raise ValueError(
                f"NetworkConfig.channel_selection_kind={self.channel_selection_kind!r}; choose one "
                f"of {CHANNEL_SELECTION_KINDS}"
            )
        if self.prompt and not self.cs_stages:
            raise ValueError("NetworkConfig: prompt/channel_selection is on but cs_stages is empty")
        self._check_temporal_variant()
        if len(self.receptive_fields) != len(self.pool_sizes):
            raise ValueError(
                f"NetworkConfig: receptive_fields {self.receptive_fields} and pool_sizes "
                f"{self.pool_sizes} must have one entry per frame"
            )
        if self.num_classes < 1 or self.decoder_dim < 1 or self.indicator_dim < 1:
            raise ValueError(
                "NetworkConfig: num_classes, decoder_dim and indicator_dim must be positive"
            )

    def _check_temporal_variant(self) -> None:
        if self.temporal_variant not in TEMPORAL_VARIANTS:
            raise ValueError(
                f"NetworkConfig.temporal_variant={self.temporal_variant!r}; choose one of "
                f"{TEMPORAL_VARIANTS}"
            )
        if self.temporal_alignment not in ALIGNMENTS:
            raise ValueError(
                f"NetworkConfig.temporal_alignment={self.temporal_alignment!r}; choose one of "
                f"{ALIGNMENTS}"
            )
        if self.temporal_position_bias not in POSITION_BIASES:
            raise ValueError(
                f"NetworkConfig.temporal_position_bias={self.temporal_position_bias!r}; choose "
                f"one of {POSITION_BIASES}"
            )
        if self.temporal_placement not in TEMPORAL_PLACEMENTS:
            raise ValueError(
                f"NetworkConfig.temporal_placement={self.temporal_placement!r}; choose one of "
                f"{TEMPORAL_PLACEMENTS}"
            )
        if self.temporal_placement == "decode_head" and self.temporal_variant != "cffm":
            raise ValueError(
                "NetworkConfig: temporal_placement='decode_head' is CFFM's placement and builds "
                f"the 'cffm' block; temporal_variant={self.temporal_variant!r} is not supported "
                "there (set network.temporal_variant=cffm or network.temporal_placement=encoder)"
            )
        earlier = len(self.receptive_fields) - 1
        if self.temporal_variant == "cffm" and not (
            len(self.temporal_tokens_per_window) == len(self.temporal_context_tokens) == earlier
        ):
            raise ValueError(
                "NetworkConfig: temporal_tokens_per_window "
                f"{self.temporal_tokens_per_window} and temporal_context_tokens "
                f"{self.temporal_context_tokens} need one entry per earlier frame ({earlier}: "
                f"receptive_fields {self.receptive_fields} sets the clip length)"
            )

    @property
    def num_frames(self) -> int:
        """Clip length T the temporal module consumes."""
        return len(self.receptive_fields)

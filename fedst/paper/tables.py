"""What each table of the paper needs: its rows (a method or an ablation of configs/, in the
paper's order), which runs of them it reads, and how its values are laid out (:data:`TABLES`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedst.cli import CONFIG_DIR
from fedst.errors import UserError
from fedst.experiment import ExperimentConfig

DEFAULT_SEEDS = (0, 1, 2)
"""The paper repeats every experiment with three seeds (Sec. IV-A3)."""
RUNNER_KEYS = ("seeds", "rows")
REFUSED_KEYS = ("seed", "resume", "site", "method", "ablation")


class RunnerError(UserError, ValueError):
    """A runner request that cannot be carried out; the message names the key or file and the fix."""


# -- what a table needs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One row of a table: a method (``configs/method/<name>.yaml``) or an ablation
    (``configs/ablation/<name>.yaml``, applied on top of the default method, FedST)."""

    label: str
    name: str
    """The row's key (``rows=``) and run directory stem (``<name>_s<seed>``)."""
    group: str = "method"
    marks: tuple[str, ...] = ()
    """Descriptive cells of the row (Table IV's component ticks, Table V's personalized layers,
    Fig. 5's line colour)."""
    config: str | None = None
    """The config file of ``group`` when it is not ``name`` (Fig. 7: every method's
    ``<method>_synthetic`` row is the one ablation fig7_synthetic)."""
    method: str | None = None
    """An ablation row's method (``method=<name>``); None: the default method, FedST."""
    iters_factor: int = 1
    """``train.total_iters`` of the row's runs as a multiple of the experiment's (Fig. 7, Fig.
    5's green line: 2, the paper's doubled iterations); the rounds follow it (:func:`compose_row`)."""

    @property
    def config_files(self) -> tuple[Path, ...]:
        """The config files the row composes: its own, and its method's for an ablation on one."""
        own = CONFIG_DIR / self.group / f"{self.config or self.name}.yaml"
        return (*([CONFIG_DIR / "method" / f"{self.method}.yaml"] if self.method else []), own)

    def overrides(self) -> list[str]:
        config = self.config or self.name
        if self.group == "method":
            return [f"method={config}"]
        return [*([f"method={self.method}"] if self.method else []), f"+ablation={config}"]


@dataclass(frozen=True)
class TableSpec:
    """A table of the paper: its rows in the paper's order and how its cells are computed."""

    name: str
    caption: str
    rows: tuple[Row, ...]
    kind: str
    """"sites" (Table II), "outfed" (Tables III / VIII), "efficiency" (Table IX), "dice"
    (Tables IV-VII, Fig. 6: Dice per federated site, Avg. and site E), "curves" (Fig. 5: Dice
    per site and Avg. at every evaluated round) or "paired" (Fig. 7: Dice per site, Avg. and
    site E without and with synthetic data in training, rows of one label paired)."""
    site: str | None = None
    """The out-of-federation site of an "outfed" table."""
    mark_headers: tuple[str, ...] = ()


def _methods(*pairs: tuple[str, str]) -> tuple[Row, ...]:
    return tuple(Row(label, name) for label, name in pairs)


def _ablations(*rows: tuple[str, str, tuple[str, ...]]) -> tuple[Row, ...]:
    return tuple(Row(label, name, "ablation", marks) for label, name, marks in rows)


def _variants(table: str, **suffixes: str) -> tuple[Row, ...]:
    """Ablations ``configs/ablation/<table>_<suffix>.yaml``, labelled by keyword, in order."""
    return tuple(Row(label, f"{table}_{suffix}", "ablation") for label, suffix in suffixes.items())


LOCAL, UPPER, FEDST = ("Local Train", "local"), ("Upper Bound", "upperbound"), ("FedST", "fedst")
FEDLD, FEDDP, FEDAVG = ("FedLD", "fedld"), ("FedDP", "feddp"), ("FedAvg", "fedavg")
FEDREP, FEDAS = ("FedRep", "fedrep"), ("FedAS", "fedas")
X = "x"
TABLE_II_ORDER = _methods(LOCAL, UPPER, FEDLD, FEDDP, FEDAVG, FEDREP, FEDAS, FEDST)
"""Table II's row order (the paper's Tables III, VIII and IX list the same methods in another)."""
TABLE_III_ORDER = _methods(LOCAL, UPPER, FEDDP, FEDAS, FEDLD, FEDAVG, FEDREP, FEDST)

SYNTHETIC_IN_SITES = "fig7_synthetic"
"""The ablation that mixes the synthetic set into every site's training data (Fig. 7)."""
DOUBLED = 2
"""Fig. 7 (Sec. IV-C6): "the number of training iterations is doubled" with synthetic data."""


def _with_and_without_synthetic(*pairs: tuple[str, str]) -> tuple[Row, ...]:
    """Fig. 7's rows: each baseline as in Table II (its run directory), then the same method with
    the synthetic set mixed into every site's data and train.total_iters doubled; FedST once, as
    it is (its synthetic data enters through SERQ)."""
    rows: list[Row] = []
    for label, name in pairs:
        rows.append(Row(label, name))
        if name != FEDST[1]:
            rows.append(
                Row(
                    label,
                    f"{name}_synthetic",
                    "ablation",
                    config=SYNTHETIC_IN_SITES,
                    method=name,
                    iters_factor=DOUBLED,
                )
            )
    return tuple(rows)


def synthetic_in_training(cfg: ExperimentConfig) -> bool:
    """Whether a run trains with the synthetic set beyond the pre-training every method starts
    from (Fig. 7's darker bars): mixed into the sites' data, or at the server after aggregation
    (SERQ or its fine-tuning). The paper: "all experiments without the SERQ module do not utilize
    any synthetic data during training"."""
    return cfg.data.mix_synthetic or cfg.method.serq


TABLES: dict[str, TableSpec] = {
    spec.name: spec
    for spec in (
        TableSpec(
            "table2",
            "Table II: comparison on the federated sites A-D (personalized models)",
            TABLE_II_ORDER,
            "sites",
        ),
        TableSpec(
            "table3", "Table III: out-of-federation site E", TABLE_III_ORDER, "outfed", site="E"
        ),
        TableSpec(
            "table8",
            "Table VIII: unseen binary segmentation site (GraSP)",
            TABLE_III_ORDER,
            "outfed",
            site="grasp",
        ),
        TableSpec(
            "table9", "Table IX: communication and efficiency", TABLE_III_ORDER, "efficiency"
        ),
        TableSpec(
            "table4",
            "Table IV: ablation of the key components (Dice)",
            _ablations(
                ("1 (FedDP baseline)", "table4_row1_baseline", ("", "", "", "")),
                ("2", "table4_row2_ts", (X, "", "", "")),
                ("3", "table4_row3_ts_prompt", (X, X, "", "")),
                ("4", "table4_row4_ts_prompt_cs", (X, X, X, "")),
                ("5", "table4_row5_serq", ("", "", "", X)),
                ("6", "table4_row6_ts_serq", (X, "", "", X)),
                ("7 (FedST)", "table4_row7_full", (X, X, X, X)),
            ),
            "dice",
            mark_headers=("TS", "Prompt", "CS", "SERQ"),
        ),
        TableSpec(
            "table5",
            "Table V: personalizing different layers of the attention networks (Dice)",
            _ablations(
                ("1 (all shared)", "table5_row1_none", ("", "", "")),
                ("2 (all personalized)", "table5_row2_all", ("Δ", "Δ", "Δ")),
                ("3", "table5_row3_decoder_query", ("", "Δ", "")),
                ("4", "table5_row4_encoder_decoder_query", ("Δ", "Δ", "")),
                ("5 (FedST)", "table5_row5_encoder_query", ("Δ", "", "")),
            ),
            "dice",
            mark_headers=("Encoder Attn.q", "Decoder Attn.q", "Decoder Other"),
        ),
        TableSpec(
            "table6",
            "Table VI: personalized layers of the PVT backbone (Dice)",
            _variants(
                "table6",
                Norm="norm",
                Key="key",
                Value="value",
                **{"Key&Value": "key_value"},
                **{"Ours (Query)": "query"},
            ),
            "dice",
        ),
        TableSpec(
            "table7",
            "Table VII: site indicator of the channel selection network (Dice)",
            _variants(
                "table7",
                Random="random",
                Gaussian="gaussian",
                **{"One-hot": "onehot"},
                **{"Ours (CLIP)": "clip"},
            ),
            "dice",
        ),
        TableSpec(
            "fig5",
            "Fig. 5: learning curves of the ways to use the synthetic set (test Dice)",
            (
                Row("Server fine-tuning", "fig5_server_finetune", "ablation", ("blue",)),
                Row(
                    "Synthetic at the sites",
                    "fig5_local_synthetic",
                    "ablation",
                    ("green",),
                    iters_factor=DOUBLED,
                ),
                Row("SERQ (FedST)", "fig5_serq", "ablation", ("red",)),
            ),
            "curves",
            mark_headers=("Line",),
        ),
        TableSpec(
            "fig7",
            "Fig. 7: Dice without and with synthetic data in training",
            _with_and_without_synthetic(LOCAL, UPPER, FEDLD, FEDDP, FEDAVG, FEDREP, FEDAS, FEDST),
            "paired",
            site="E",
        ),
        TableSpec(
            "fig6",
            "Fig. 6: communication every E local iterations at a fixed total (Dice)",
            _variants("fig6", **{f"every {e}": f"every_{e}" for e in (10, 50, 100, 200, 500)}),
            "dice",
        ),
    )
}

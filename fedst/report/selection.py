"""Reports of model selection and cross-site evaluation: the msf and matrix commands of fedst.report.

``msf RUN [RUN ...]``: per run, the round each selection rule chooses (fedst/runs/model_selection.py), whether
the conventional (``mixed``, GEN-Guard Eq. 6) and client-blocked (``cbe``, Eq. 7) choices differ (a
model-selection failure, MSF), and each choice's test scores in federation (mean Dice of the
training sites' personalized models) and out of federation (the averaged model on each
``data.out_of_federation`` site), with the gap in - out. The test scores are those of
``selection/selection.json``: measured after the rounds were chosen on validation (computed here
when a run lacks the file). Also, per run, ``msf_<run>.png``: validation (solid) and test (dashed,
logged during training every ``train.eval_every`` rounds) Dice per site, with the chosen rounds
marked. When GEN-Guard's correction has run (``python -m fedst.guard RUN``, fedst/guard/), a
second table gives the corrected models' test Dice before (the ``mixed`` student) and after DAD:
in-federation mean, held-out site, each out-of-federation site, their mean and the worst site
(GEN-Guard reports worst-case institutional performance); scored only once DAD has finished
(``selection/guard.json``).

``matrix RUN [--rule last|val|mixed|cbe]``: every training site's personalized model v_k and the
out-of-federation model of the run's last round (default) or of the rounds a selection rule chose
on validation (``selection/selection.json``, from the kept snapshots; ``val`` chooses no round for
the out-of-federation model, so its row is left out), each on every site's test split (rows:
models; columns: test sites; diagonal: in-distribution, off-diagonal: cross-distribution,
UltraFlwr). A personalized model is run as
deployed, with its own site indicator; the out-of-federation model with the test site's own
(fedst/runs/outfed.py). Markdown table (``matrix.md``), CSV and heat map (``matrix.png``).
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedst.errors import ArgumentParser
from fedst.report.results import RunError
from fedst.runs.device_option import add_device_option, device_run
from fedst.runs.files import unfinished
from fedst.runs.layout import CONFIG_JSON, FINAL_JSON, METRICS_JSONL, SELECTION_FILE
from fedst.scoring.formatting import format_score
from fedst.storage import read_jsonl, require_output_folder

if TYPE_CHECKING:
    from fedst.runs import Run

# fedst.runs.model_selection (OUTFED_MODEL, SelectionError, validation_rows) imports torch and the
# scoring stack: it is imported where a command uses it, so that `--help` and a wrong argument
# answer before torch loads.

log = logging.getLogger(__name__)

SUBCOMMANDS: dict[str, str] = {
    "msf": "rounds chosen by each selection rule, MSF, test scores (and DAD's, when it ran)",
    "matrix": "every model of a run on every site's test split (cross-site evaluation)",
}
"""The subcommands of ``python -m fedst.report``, each with its one line of help."""
RULE_ORDER = ("last", "val", "mixed", "cbe")


def finished_run(run_dir: Path, command: str, device: str | None = None) -> Run:
    """The finished run in ``run_dir`` scored on ``device`` (``--device``; None: its own
    train.device); a :class:`RunError` naming the folder and the fix when it is not one
    (``command`` starts the message, e.g. "msf")."""
    if not (run_dir / CONFIG_JSON).is_file():
        raise RunError(
            f"{command}: {run_dir} is not a run directory (no config.json); pass a folder "
            "train_fed.py wrote"
        )
    reason = unfinished(run_dir)
    if reason is not None:
        raise RunError(
            f"{command}: {run_dir} is not a finished run ({reason}); let its training "
            f"finish (train_fed.py resume={run_dir}), then report it"
        )
    return device_run(run_dir, device)


def require_validation(run: Run, command: str, alternative: str = "") -> None:
    """A :class:`SelectionError` naming the run and the fix unless it scored validation rounds
    (every rule but ``last`` chooses among them; fedst/runs/model_selection.py). ``alternative``: another
    fix, appended ("or ...")."""
    cfg, run_dir = run.cfg, run.dir
    fix = "train a run with train.val_every=<k> (1 <= k <= train.rounds) to select its rounds"
    if alternative:
        fix = f"{alternative}, or {fix}"
    if cfg.train.val_every is None:
        why = "train.val_every=null"
    elif not any(r.get("split") == "val" for r in read_jsonl(run_dir / METRICS_JSONL)):
        why = f"train.val_every={cfg.train.val_every}, train.rounds={cfg.train.rounds}"
    else:
        return
    from fedst.runs.model_selection import SelectionError

    raise SelectionError(
        f"{command}: {run_dir} scored no validation round ({why} in its config.json), so no "
        f"selection rule can choose one; {fix}"
    )


def _mean(values: Sequence[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def load_selection(
    run_dir: Path, progress: bool = False, command: str = "msf", device: str | None = None
) -> dict[str, Any]:
    """``selection/selection.json`` of a run (computed now when absent, on ``device``: rounds on
    validation, then test scores of the choices; a finished run with validation rounds is
    required, see :func:`finished_run` and :func:`require_validation`)."""
    path = run_dir / SELECTION_FILE
    if not path.exists():
        from fedst.runs.model_selection import run_selection

        run = finished_run(run_dir, command, device)
        require_validation(run, command)
        run_selection(run, run.device, progress=progress)
    return json.loads(path.read_text())


def msf_rows(run_dir: Path, record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per rule: chosen rounds, in-/out-of-federation test Dice and their gap."""
    rows = []
    for rule in [r for r in RULE_ORDER if r in record["choices"]]:
        choice, test = record["choices"][rule], record["test"][rule]
        in_fed = _mean([v["dice"] for v in test["in_federation"].values()])
        out_sites = {s: v["dice"] for s, v in test["out_of_federation"].items()}
        out_fed = _mean(list(out_sites.values())) if out_sites else None
        rows.append(
            {
                "run": run_dir.name,
                "rule": rule,
                "site_rounds": choice["sites"],
                "outfed_round": choice["outfed"],
                "in_fed_dice": in_fed,
                "out_fed_dice": out_sites,
                "out_fed_mean": out_fed,
                "gap": None if in_fed is None or out_fed is None else in_fed - out_fed,
            }
        )
    return rows


def msf_markdown(runs: Mapping[Path, Mapping[str, Any]]) -> str:
    """The MSF table of every run (markdown)."""
    out_sites = sorted(
        {s for r in runs.values() for t in r["test"].values() for s in t["out_of_federation"]}
    )
    header = ["run", "rule", "rounds (site: round)", "out-fed round", "in-fed Dice"]
    header += [f"{s} Dice" for s in out_sites] + ["out-fed mean", "gap (in - out)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes = []
    for run_dir, record in runs.items():
        for row in msf_rows(run_dir, record):
            rounds = ", ".join(f"{s}: {r}" for s, r in row["site_rounds"].items())
            cells = [row["run"], row["rule"], rounds, str(row["outfed_round"] or "n/a")]
            cells += [format_score(row["in_fed_dice"])]
            cells += [format_score(row["out_fed_dice"].get(s)) for s in out_sites]
            cells += [format_score(row["out_fed_mean"]), format_score(row["gap"])]
            lines.append("| " + " | ".join(cells) + " |")
        msf = record["model_selection_failure"]
        choices = record["choices"]
        if msf is None:
            notes.append(
                f"- {run_dir.name}: no held-out site (selection.held_out_site), no MSF test"
            )
            continue
        mixed, cbe = choices["mixed"]["outfed"], choices["cbe"]["outfed"]
        delta = (
            _mean([v["dice"] for v in record["test"]["cbe"]["out_of_federation"].values()]),
            _mean([v["dice"] for v in record["test"]["mixed"]["out_of_federation"].values()]),
        )
        diff = None if None in delta else delta[0] - delta[1]
        notes.append(
            f"- {run_dir.name}: conventional (mixed, Eq. 6) round {mixed}, client-blocked (cbe, "
            f"Eq. 7, held-out site {record['held_out_site']}) round {cbe}: "
            f"{'MSF' if msf else 'no MSF'}; out-fed mean Dice cbe - mixed = {format_score(diff)}"
        )
    failures = [r["model_selection_failure"] for r in runs.values()]
    tested = [f for f in failures if f is not None]
    summary = (
        f"MSF in {sum(tested)} of {len(tested)} run(s) with a held-out site." if tested else ""
    )
    metric = {r["metric"] for r in runs.values()}
    return "\n".join(
        [
            f"Selection on validation ({', '.join(sorted(metric))}); test Dice (%) of each choice, "
            "measured after selection.",
            "",
            *lines,
            "",
            *notes,
            summary,
        ]
    )


def load_guard(
    run_dir: Path, progress: bool = False, device: str | None = None
) -> dict[str, Any] | None:
    """Test scores before and after DAD of a run's corrections, on ``device`` (None: DAD never
    ran on it)."""
    from fedst.guard import guard_test_scores

    run = device_run(run_dir, device)
    return guard_test_scores(run, run.device, progress)


def dad_rows(run_dir: Path, scores: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Rows "before" (the mixed student) and "after DAD": in-federation mean, held-out and
    out-of-federation Dice per site, out-of-federation mean and the worst scored site."""
    rows = []
    for stage in ("before", "after"):
        in_fed = {s: v[stage]["dice"] for s, v in scores["in_federation"].items()}
        held_out = {s: v[stage]["dice"] for s, v in scores["held_out"].items()}
        out_fed = {s: v[stage]["dice"] for s, v in scores["out_of_federation"].items()}
        every = {s: d for s, d in {**in_fed, **held_out, **out_fed}.items() if d is not None}
        worst = min(every, key=every.get) if every else None
        rows.append(
            {
                "run": run_dir.name,
                "stage": stage,
                "in_fed_dice": _mean(list(in_fed.values())) if in_fed else None,
                "site_dice": {**held_out, **out_fed},
                "out_fed_mean": _mean(list(out_fed.values())) if out_fed else None,
                "worst_site": worst,
                "worst_dice": every.get(worst),
            }
        )
    return rows


def dad_markdown(guards: Mapping[Path, Mapping[str, Any]]) -> str:
    """The table of the corrected models (markdown): before (student, rule mixed) and after DAD."""
    sites = list(
        dict.fromkeys(
            s
            for g in guards.values()
            for part in ("held_out", "out_of_federation")
            for s in g[part]
        )
    )
    header = ["run", "model", "in-fed Dice"] + [f"{s} Dice" for s in sites]
    header += ["out-fed mean", "worst site"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run_dir, scores in guards.items():
        rounds = scores["rounds"]
        names = {
            "before": f"mixed (student, round {rounds['student']})",
            "after": f"mixed + DAD (teacher: cbe round {rounds['teacher']})",
        }
        for row in dad_rows(run_dir, scores):
            cells = [row["run"], names[row["stage"]], format_score(row["in_fed_dice"])]
            cells += [format_score(row["site_dice"].get(s)) for s in sites]
            worst = (
                "n/a"
                if row["worst_site"] is None
                else f"{row['worst_site']} {format_score(row['worst_dice'])}"
            )
            cells += [format_score(row["out_fed_mean"]), worst]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(
        [
            "GEN-Guard correction (DAD, fedst/guard/): test Dice (%) of the corrected models "
            "before and after DAD, measured after DAD finished; held-out and out-of-federation "
            "sites: the out-of-federation model corrected at the held-out site (zero-shot).",
            "",
            *lines,
        ]
    )


def plot_msf(run_dir: Path, record: Mapping[str, Any], out_png: Path) -> Path:
    """Validation (solid) and test (dashed) Dice per site against the round, chosen rounds marked."""
    from fedst.report.plots import new_figure, save_figure
    from fedst.runs.model_selection import OUTFED_MODEL, validation_rows

    metrics = read_jsonl(run_dir / METRICS_JSONL)
    val = validation_rows(run_dir)
    tests = [r for r in metrics if r.get("split", "test") == "test" and r["model"] == "personal"]
    choices = record["choices"]
    panels = list(choices["last"]["sites"])
    held_out = record.get("held_out_site")
    if held_out:
        panels.append(held_out)
    fig, axes = new_figure(1, len(panels), figsize=(3.2 * len(panels), 3.0), sharey=True)
    styles = {"last": ("grey", ":"), "mixed": ("tab:blue", "--"), "cbe": ("tab:red", "-.")}
    for ax, site in zip(axes[0], panels, strict=True):
        model = OUTFED_MODEL if site == held_out else "personal"
        for rows, style, label in ((val, "-o", "val"), (tests, "--s", "test")):
            points = sorted(
                (r["round"], r["dice"])
                for r in rows
                if r["site"] == site
                and r.get("model", "personal") == model
                and r["dice"] is not None
            )
            if points:
                ax.plot(*zip(*points, strict=True), style, ms=3, label=label)
        for rule, (colour, line) in styles.items():
            if rule in choices:
                chosen = choices[rule]["sites"].get(site, choices[rule]["outfed"])
                if chosen is not None:
                    ax.axvline(chosen, color=colour, ls=line, lw=1, label=f"{rule}: {chosen}")
        if site in choices["val"]["sites"]:
            ax.axvline(
                choices["val"]["sites"][site],
                color="tab:green",
                lw=1,
                alpha=0.6,
                label=f"val: {choices['val']['sites'][site]}",
            )
        title = f"{site} (held out, out-fed model)" if site == held_out else site
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("round")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("Dice (%)")
    fig.suptitle(f"{run_dir.name}: validation and test curves, selected rounds", fontsize=9)
    return save_figure(fig, out_png)


def msf_report(
    run_dirs: Sequence[Path], out: Path, progress: bool = False, device: str | None = None
) -> list[Path]:
    """The MSF table (and DAD's) of ``run_dirs`` in ``out``: msf.md, msf.csv, a plot per run;
    models scored on ``device`` (``--device``; None: each run's train.device). Every run is
    checked before any is scored (:func:`load_selection`'s requirements)."""
    for run_dir in run_dirs:
        run = finished_run(run_dir, "msf", device)
        if not (run_dir / SELECTION_FILE).exists():
            require_validation(run, "msf")
    runs = {run_dir: load_selection(run_dir, progress, device=device) for run_dir in run_dirs}
    guards = {run_dir: load_guard(run_dir, progress, device) for run_dir in run_dirs}
    guards = {run_dir: scores for run_dir, scores in guards.items() if scores is not None}
    out.mkdir(parents=True, exist_ok=True)
    text = msf_markdown(runs)
    if guards:
        text += "\n\n" + dad_markdown(guards)
    (out / "msf.md").write_text(text + "\n")
    written = [out / "msf.md"]
    with open(out / "msf.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "run",
                "rule",
                "site_rounds",
                "outfed_round",
                "in_fed_dice",
                "out_fed_dice",
                "out_fed_mean",
                "gap",
            ]
        )
        for run_dir, record in runs.items():
            for row in msf_rows(run_dir, record):
                writer.writerow(
                    [
                        row["run"],
                        row["rule"],
                        json.dumps(row["site_rounds"]),
                        row["outfed_round"],
                        row["in_fed_dice"],
                        json.dumps(row["out_fed_dice"]),
                        row["out_fed_mean"],
                        row["gap"],
                    ]
                )
    written.append(out / "msf.csv")
    for run_dir, record in runs.items():
        written.append(plot_msf(run_dir, record, out / f"msf_{run_dir.name}.png"))
    print(text)
    return written


# -- the cross-site matrix ---------------------------------------------------------------------


def cross_site_matrix(
    run_dir: Path, rule: str = "last", progress: bool = False, device: str | None = None
) -> dict[str, Any]:
    """{"rule", "rounds", "models", "sites", "dice": [[...]], "iou": [[...]]}: each model of the
    run's last round (``rule="last"``) or of the rounds ``rule`` chose on validation, on each
    site's test split (rows: models, columns: test sites; ``rounds``: model -> its round), on
    ``device`` (``--device``; None: the run's train.device).

    A folder that is not a finished run, and a rule the run cannot apply (``cbe`` without
    ``selection.held_out_site``, any rule but ``last`` without validation rounds), are refused
    before anything is evaluated: a :class:`RunError` or :class:`SelectionError` of one line."""
    command = f"matrix --rule {rule}"
    run = finished_run(run_dir, command, device)
    from fedst.runs.model_selection import OUTFED_MODEL, SelectionError
    from fedst.scoring.evaluation import evaluate_model
    from fedst.scoring.site_data import open_site_data

    cfg = run.cfg
    if rule == "cbe" and cfg.selection.held_out_site is None:
        others = "last" if cfg.train.val_every is None else "last, val or mixed"
        raise SelectionError(
            f"{command}: {run_dir} has no held-out site (selection.held_out_site=null in its "
            f"config.json), and client-blocked selection (cbe) scores one; use --rule {others}, "
            "or train a run with selection.held_out_site=<site> train.val_every=<k>"
        )
    choices: dict[str, Any] = {}
    if rule != "last":
        if not (run_dir / SELECTION_FILE).exists():
            require_validation(run, command, "use --rule last")
        choices = load_selection(run_dir, progress, command, device)["choices"]
        if rule not in choices:
            raise SelectionError(
                f"{command}: {run_dir / SELECTION_FILE} holds no choice of that rule (it has "
                f"{', '.join(sorted(choices))}); delete it to choose again with today's rules, "
                "or pick one of those"
            )
    device = run.device
    indicators = run.method.indicators()
    sites = [*cfg.data.federation, *cfg.data.out_of_federation]
    tests = {s: open_site_data(cfg, s, ("test",)).test for s in sites}
    if rule == "last":
        last = json.loads((run_dir / FINAL_JSON).read_text())["rounds"]
        rounds: dict[str, int | None] = dict.fromkeys(cfg.data.federation, last)
        models = {s: (run.site_model(s, device), s) for s in cfg.data.federation}
        if cfg.data.out_of_federation:
            models[OUTFED_MODEL] = (run.outfed_model(device), None)
            rounds[OUTFED_MODEL] = last
    else:
        rounds = dict(choices[rule]["sites"])
        models = {s: (run.site_model(s, device, round=rounds[s]), s) for s in cfg.data.federation}
        outfed_round = choices[rule]["outfed"]
        if cfg.data.out_of_federation and outfed_round is not None:
            model = run.outfed_model(device, round=outfed_round)
            models[OUTFED_MODEL] = (model, None)
            rounds[OUTFED_MODEL] = outfed_round
    dice, iou = [], []
    for name, (model, own_site) in models.items():
        row_d, row_i = [], []
        for site in sites:
            indicator = indicators.get(own_site if own_site is not None else site)
            summary = evaluate_model(
                model,
                tests[site],
                indicator,
                device,
                progress=progress,
                **cfg.train.evaluation_options(),
            ).summary
            row_d.append(summary["dice"])
            row_i.append(summary["iou"])
            log.info(
                "matrix: model %s on %s test: Dice %s", name, site, format_score(summary["dice"])
            )
        dice.append(row_d)
        iou.append(row_i)
    return {
        "rule": rule,
        "rounds": rounds,
        "models": list(models),
        "sites": sites,
        "dice": dice,
        "iou": iou,
    }


def matrix_markdown(matrix: Mapping[str, Any], metric: str = "dice") -> str:
    from fedst.runs.model_selection import OUTFED_MODEL

    sites = matrix["sites"]
    rounds = ", ".join(f"{m}: {r}" for m, r in matrix["rounds"].items())
    lines = [
        f"{metric} (%) on each site's test split; rows: models (v_k of a training site, "
        f"'{OUTFED_MODEL}': the out-of-federation model); diagonal: in-distribution. "
        f"Rounds (rule {matrix['rule']}): {rounds}.",
        "",
        "| model \\ test site | " + " | ".join(sites) + " |",
        "|" + "---|" * (len(sites) + 1),
    ]
    for name, values in zip(matrix["models"], matrix[metric], strict=True):
        cells = [
            f"**{format_score(v)}**" if name == s else format_score(v)
            for s, v in zip(sites, values, strict=True)
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_matrix(matrix: Mapping[str, Any], out_png: Path, metric: str = "dice") -> Path:
    from fedst.report.plots import new_figure, save_figure

    values = np.array(
        [[np.nan if v is None else v for v in row] for row in matrix[metric]], dtype=float
    )
    fig, axes = new_figure(
        1, 1, figsize=(1.0 + 0.9 * len(matrix["sites"]), 1.0 + 0.6 * len(matrix["models"]))
    )
    ax = axes[0][0]
    image = ax.imshow(values, cmap="viridis", vmin=0, vmax=100)
    ax.set_xticks(range(len(matrix["sites"])), matrix["sites"])
    ax.set_yticks(range(len(matrix["models"])), matrix["models"])
    ax.set_xlabel("test site")
    ax.set_ylabel("model")
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            ax.text(
                j,
                i,
                "n/a" if np.isnan(value) else format_score(value, 1),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if np.isnan(value) or value < 50 else "black",
            )
    fig.colorbar(image, ax=ax, label=f"{metric} (%)")
    return save_figure(fig, out_png)


def matrix_report(
    run_dir: Path, out: Path, rule: str = "last", progress: bool = False, device: str | None = None
) -> list[Path]:
    matrix = cross_site_matrix(run_dir, rule, progress, device)
    out.mkdir(parents=True, exist_ok=True)
    stem = "matrix" if rule == "last" else f"matrix_{rule}"
    text = matrix_markdown(matrix)
    (out / f"{stem}.md").write_text(text + "\n\n" + matrix_markdown(matrix, "iou") + "\n")
    (out / f"{stem}.json").write_text(json.dumps(matrix, indent=1))
    with open(out / f"{stem}.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["model", *matrix["sites"]])
        for name, row in zip(matrix["models"], matrix["dice"], strict=True):
            writer.writerow([name, *row])
    written = [out / f"{stem}.{ext}" for ext in ("md", "json", "csv")]
    written.append(plot_matrix(matrix, out / f"{stem}.png"))
    print(text)
    return written


def main(argv: Sequence[str]) -> list[Path]:
    parser = ArgumentParser(prog="python -m fedst.report", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    msf_help = SUBCOMMANDS["msf"]
    msf = sub.add_parser("msf", help=msf_help, description=f"Model selection: {msf_help}.")
    msf.add_argument("run_dirs", nargs="+", type=Path, help="run directories (seeds of one method)")
    msf.add_argument("--out", type=Path, help="output folder (default: <first RUN>/report)")
    matrix_help = SUBCOMMANDS["matrix"]
    matrix = sub.add_parser(
        "matrix", help=matrix_help, description=f"Cross-site evaluation: {matrix_help}."
    )
    matrix.add_argument("run_dir", type=Path, help="a finished run directory")
    matrix.add_argument(
        "--rule",
        choices=RULE_ORDER,
        default="last",
        help="models of the last round (default) or of the rounds this selection rule chose",
    )
    matrix.add_argument("--out", type=Path, help="output folder (default: <RUN>/report)")
    for scoring in (msf, matrix):
        add_device_option(scoring)
    args = parser.parse_args(list(argv))
    if args.out is not None:  # before any run is read
        require_output_folder(args.out, "--out")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "msf":
        out = args.out or args.run_dirs[0] / "report"
        written = msf_report(args.run_dirs, out, device=args.device)
    else:
        out = args.out or args.run_dir / "report"
        written = matrix_report(args.run_dir, out, args.rule, device=args.device)
    for path in written:
        print(f"wrote {path}")
    return written

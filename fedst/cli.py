"""Shared plumbing of the Hydra entry points (train_fed.py, eval_outfed.py): the typed config,
resume, logging, and their error boundary (Hydra's config errors in one line, no run directory
left behind by a failed command)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, NoReturn

from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedst.config import ConfigError, build, did_you_mean, to_dict
from fedst.data.sites import DataConfig
from fedst.errors import one_line, run_entry_point
from fedst.experiment import ExperimentConfig, Runtime, experiment_from_dict, resume_safe_keys

RUNTIME_KEYS = tuple(item.name for item in dataclasses.fields(Runtime))
"""Top-level keys that steer the entry point, not the experiment (:class:`Runtime`)."""

log = logging.getLogger(__name__)


DEFAULTS_NODE = "fedst_defaults"


def register_resolvers() -> None:
    """Prepare Hydra for our configs (idempotent).

    * ``${fedst.div:a,b}`` = a // b (rounds = total_iters // local_iters in experiment configs).
    * ``${fedst.curve_every:rounds,points}`` = max(1, rounds // points): the evaluation interval
      that gives a learning curve about ``points`` points (the Fig. 5 ablations' train.eval_every).
    * ``fedst_defaults``: every field of the typed configs (fedst/experiment/ and the dataclasses
      it holds) with its dataclass default, stored in Hydra's ConfigStore and listed first in
      configs/config.yaml. Defaults are thus defined once, in code, and every key can be
      overridden from the command line (``method.serq=false``) while a typo is still an error.
    """
    if not OmegaConf.has_resolver("fedst.div"):
        OmegaConf.register_new_resolver("fedst.div", _integer_division)
    if not OmegaConf.has_resolver("fedst.curve_every"):
        OmegaConf.register_new_resolver("fedst.curve_every", _curve_every)
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=DEFAULTS_NODE, node=_experiment_defaults())


def _integer_division(a: Any, b: Any) -> int:
    """``${fedst.div:a,b}``: rounds = train.total_iters // train.local_iters."""
    if not (_is_int(a) and _is_int(b) and int(b) >= 1):
        raise ConfigError(
            f"train.total_iters={a!r}, train.local_iters={b!r} (rounds = total_iters // "
            "local_iters): both must be integers and train.local_iters >= 1"
        )
    return int(a) // int(b)


def _curve_every(rounds: Any, points: Any) -> int:
    """``${fedst.curve_every:rounds,points}``: evaluate every max(1, rounds // points) rounds."""
    if not (_is_int(rounds) and _is_int(points) and int(points) >= 1):
        raise ConfigError(
            f"fedst.curve_every: rounds={rounds!r}, points={points!r}: both must be integers "
            "and points >= 1"
        )
    return max(1, int(rounds) // int(points))


def _is_int(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, str) and value.strip().lstrip("-").isdigit()
    )


def _experiment_defaults() -> dict[str, Any]:
    """Defaults of every ExperimentConfig field; of ``data`` (no default: its sites are the data
    config's), the defaults of its other fields (e.g. ``data.mix_synthetic``)."""
    values: dict[str, Any] = {
        item.name: to_dict(_default(item))
        for item in dataclasses.fields(ExperimentConfig)
        if item.name != "data"
    }
    values["data"] = {
        item.name: to_dict(_default(item))
        for item in dataclasses.fields(DataConfig)
        if item.default is not dataclasses.MISSING
        or item.default_factory is not dataclasses.MISSING
    }
    values.update(to_dict(Runtime()))  # engine, resume, ..., deploy.*, ray.*: train_fed.py's
    return values


def _default(item: dataclasses.Field) -> Any:
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return item.default


def split_config(cfg: DictConfig) -> tuple[ExperimentConfig, Runtime]:
    """Resolve the Hydra config into (typed experiment, typed runtime options), every value
    checked, the method's options too (their dataclasses are torch-free); what needs the
    methods' code (combinations of options and network, :func:`check_method`) is left."""
    try:
        values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as err:  # e.g. a resolver's ConfigError, a key left at ???
        raise ConfigError(f"config: {one_line(err)}") from err
    assert isinstance(values, dict)
    values.pop("hydra", None)
    runtime = build(Runtime, {k: values.pop(k) for k in RUNTIME_KEYS if k in values})
    experiment = experiment_from_dict(values)
    experiment.method.typed_options()  # their values too, before check_method imports torch
    _check_rounds_follow_iterations(experiment)
    return experiment, runtime


def check_method(experiment: ExperimentConfig) -> None:
    """The method's own options and combinations (``method.options``, fedst/methods/): a
    ConfigError names a wrong one. Imports the methods (torch): an entry point calls it once
    the config has parsed (:func:`split_config`)."""
    from fedst.methods import method_of

    method_of(experiment)


def _check_rounds_follow_iterations(experiment: ExperimentConfig) -> None:
    """The configs derive train.rounds = total_iters // local_iters; a ``train.rounds=`` given
    on its own would run that many rounds while the saved config kept the other total."""
    train = experiment.train
    derived = train.total_iters // train.local_iters
    if train.rounds != derived:
        raise ConfigError(
            f"train.rounds={train.rounds} disagrees with train.total_iters // train.local_iters "
            f"= {train.total_iters} // {train.local_iters} = {derived} (the configs derive the "
            f"rounds from the iterations): set train.total_iters="
            f"{train.rounds * train.local_iters} for {train.rounds} rounds"
        )


def resume_experiment(
    saved: ExperimentConfig, composed: ExperimentConfig, overrides: list[str]
) -> ExperimentConfig:
    """The run's own ``saved`` config, changed only by the safe command-line ``overrides``.

    ``composed`` is the experiment Hydra built from today's configs and the same overrides; the
    values of the safe keys (the fields whose role a resume accepts, fedst/schema/roles.py: they
    change when and where the run computes, not what it learns) are taken from it (each change
    logged). An override of any other key that would change the saved value is a ConfigError
    naming it; the runtime keys (progress, engine, regenerate, ...) are always accepted.
    """
    safe = resume_safe_keys()
    saved_values, composed_values = _flatten(to_dict(saved)), _flatten(to_dict(composed))
    refused, accepted = [], []
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key.split(".")[0] in (*RUNTIME_KEYS, "hydra"):  # e.g. deploy.port, hydra.run.dir
            continue
        if key in safe:
            accepted.append(key)
        elif key not in saved_values or saved_values[key] != composed_values.get(key):
            refused.append(override)
    if refused:
        raise ConfigError(
            f"resume: the run's own config is kept, so {refused} cannot be applied (it would "
            f"change what the run learns). Accepted on resume: {list(safe)} and "
            f"{list(RUNTIME_KEYS)}; start a new run to change anything else"
        )
    for key in dict.fromkeys(accepted):
        section, name = key.split(".")
        old, new = getattr(getattr(saved, section), name), getattr(getattr(composed, section), name)
        if old != new:
            log.info("resume: %s changed from %r to %r (command line)", key, old, new)
            part = dataclasses.replace(getattr(saved, section), **{name: new})
            saved = dataclasses.replace(saved, **{section: part})
    return saved


def learning_differences(a: ExperimentConfig, b: ExperimentConfig) -> list[str]:
    """Keys (``"train.lr"``) whose values differ between ``a`` and ``b``, ignoring the keys a
    resumed run accepts (fedst.experiment.resume_safe_keys: they change when and where a run
    computes, not what it learns). Empty: a run of ``a`` is a run of ``b``."""
    flat_a, flat_b = learning_keys(to_dict(a)), learning_keys(to_dict(b))
    keys = sorted(set(flat_a) | set(flat_b))
    return [k for k in keys if flat_a.get(k) != flat_b.get(k)]


def learning_keys(values: dict[str, Any]) -> dict[str, Any]:
    """A config's values as flat keys (``{"train.lr": 3e-4, ...}``) without the keys a resumed run
    accepts (fedst.experiment.resume_safe_keys): what a run of it learns."""
    safe = resume_safe_keys()
    return {k: v for k, v in _flatten(values).items() if k not in safe}


def _flatten(values: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``{"a.b.c": value}``."""
    if not isinstance(values, dict):
        return {prefix: values}
    flat: dict[str, Any] = {}
    for key, value in values.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def setup_logging(run_dir: Path | None = None) -> None:
    """INFO and above to stderr and, with ``run_dir``, to its log.txt. Flower logs through its
    own console handler (flwr.common.logger), which colours the level names with ANSI codes:
    colour stays on a terminal only, so output piped or redirected to a file is plain text."""
    from flwr.common.logger import console_handler, update_console_handler

    from fedst.runs.layout import LOG_TXT

    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(run_dir / LOG_TXT))
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        handlers=handlers,
        force=True,
    )
    logging.getLogger("flwr").propagate = False  # Flower logs through its own handler already
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Flower HTTP request
    try:
        terminal = console_handler.stream.isatty()
    except (AttributeError, ValueError):  # no stream, or a closed one
        terminal = False
    update_console_handler(colored=terminal)


class HeldConsole(logging.Handler):
    """Stands in for the console handlers while a run is set up: holds their records until
    :meth:`show` (or a record with ``fedst.progress.SHOW_NOW``) passes them on, in order."""

    def __init__(self, consoles: list[logging.Handler]) -> None:
        super().__init__()
        self.consoles = consoles
        self.held: list[logging.LogRecord] = []
        self.shown = False

    def emit(self, record: logging.LogRecord) -> None:
        self.held.append(record)
        if self.shown or getattr(record, "show_now", False):
            self.show()

    def show(self) -> None:
        """Pass the held records on, and every later one as it comes."""
        self.shown = True
        for record in self.held:
            for console in self.consoles:
                console.handle(record)
        self.held.clear()


def console_handlers(logger: logging.Logger) -> list[logging.Handler]:
    """The handlers of ``logger`` that write to stderr or stdout (not to a file)."""
    return [
        handler
        for handler in logger.handlers
        if isinstance(handler, logging.StreamHandler)
        and not isinstance(handler, logging.FileHandler)
    ]


@contextlib.contextmanager
def console_held_while_setting_up() -> Iterator[None]:
    """While the block sets a run up (device, config, data checks), its log records reach
    log.txt as ever but not the console: when the block ends they are printed, in order; when it
    raises (a DataError, a wrong device) none is, so the error's one line is all a mistake
    prints (issue 46). A long step (a record with fedst.progress.SHOW_NOW) shows them at once."""
    root = logging.getLogger()
    consoles = console_handlers(root)
    held = HeldConsole(consoles)
    for console in consoles:
        root.removeHandler(console)
    root.addHandler(held)
    try:
        yield
        held.show()
    finally:
        root.removeHandler(held)
        for console in consoles:
            root.addHandler(console)


CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


TRAIN_KEYS_LISTED = "every key and its default: python train_fed.py --cfg job"


def compose_experiment(
    overrides: list[str], method_checked: bool = True
) -> tuple[ExperimentConfig, Runtime]:
    """The experiment train_fed.py would run with these command-line overrides (no Hydra run dir).
    A key or group option the config lacks is a ConfigError in one line, as train_fed.py's.
    ``method_checked``: also check the method's own options (:func:`check_method`, imports
    torch); False: read the config only."""
    from hydra import compose, initialize_config_dir

    register_resolvers()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("config", overrides=overrides)
    except ConfigCompositionException as err:
        reworded = hydra_config_error(err, "config", TRAIN_KEYS_LISTED, groups=True)
        if reworded is not None:
            raise reworded from err
        raise
    experiment, runtime = split_config(cfg)
    if method_checked:
        check_method(experiment)
    return experiment, runtime


# -- the error boundary of the Hydra entry points -------------------------------------------------


def existing_run(value: Any, key: str) -> Path:
    """The run directory named on the command line (``eval_outfed.py run=``, ``train_fed.py
    resume=``), checked before anything is created: an existing folder holding the config.json
    train_fed.py writes when a run starts. Otherwise a ConfigError naming ``key``."""
    from fedst.runs.layout import CONFIG_JSON  # the run package: not to read a config

    run_dir = Path(str(value))
    example = "runs/<experiment>/<method>_s<seed>_<time>"
    if not run_dir.is_dir():
        raise ConfigError(
            f"{key}={value}: no such folder; give a run directory train_fed.py wrote ({example})"
        )
    if not (run_dir / CONFIG_JSON).is_file():
        raise ConfigError(
            f"{key}={value}: not a run directory (it has no config.json); give a folder "
            f"train_fed.py wrote ({example})"
        )
    return run_dir


def config_keys(config_name: str) -> list[str]:
    """Every key of ``configs/<config_name>.yaml`` composed with no overrides, dotted
    (``train.total_iters``; also the sections, ``train``), Hydra's own excluded: what an unknown
    key is compared with. Needs Hydra not to be running (after ``@hydra.main`` returned)."""
    from hydra import compose, initialize_config_dir

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name)
    return sorted(_dotted_keys(OmegaConf.to_container(cfg, resolve=False)))


def _dotted_keys(values: dict, prefix: str = "") -> Iterator[str]:
    """Every key of nested dicts, sections included: ``train``, ``train.lr``, ..."""
    for key, value in values.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        yield name
        if isinstance(value, dict):
            yield from _dotted_keys(value, name)


def unknown_key_error(key: str, valid: list[str], keys_listed: str) -> ConfigError:
    """``unknown key 'train.totl_iters' (did you mean 'train.total_iters'?); <keys_listed>``."""
    return ConfigError(f"unknown key {key!r}{did_you_mean(key, valid)}; {keys_listed}")


def hydra_config_error(
    err: ConfigCompositionException, config_name: str, keys_listed: str, groups: bool
) -> ConfigError | None:
    """Hydra's composition error as one ConfigError line, or None to keep Hydra's own words.

    * an override of a key the config lacks (``train.totl_iters=5``; Hydra suggests appending
      it with ``+``, which the typed config then refuses): the unknown key, the closest valid one
      (:func:`config_keys`) and ``keys_listed`` (where every key is listed);
    * an option a config group lacks (``experiment=papr``): the options, the closest one first.

    ``groups``: whether the config composes groups of configs/ (train_fed.py: ``+ablation=...``
    appends the group Hydra names; eval_outfed.py has none, so ``experiment=...`` is a key it
    does not know).
    """
    if isinstance(err, MissingConfigException) and err.options and err.missing_cfg_file:
        group, _, option = str(err.missing_cfg_file).rpartition("/")
        if group:
            return ConfigError(
                f"{group}={option}: no such option in configs/{group}/"
                f"{did_you_mean(option, err.options)}; available: {', '.join(err.options)}"
            )
    found = re.match(r"Could not override '([^']+)'", str(err))
    if found is None:
        return None
    key = found.group(1)
    if groups and (CONFIG_DIR / key).is_dir():  # a group outside the defaults list: Hydra's words
        return None
    return unknown_key_error(key, config_keys(config_name), keys_listed)


class NewRunDirectories(Callback):
    """Hydra callback (configs/config.yaml ``hydra.callbacks``): notes the run directory
    (``hydra.run.dir``) or the sweep directory (``hydra.sweep.dir``) this invocation is about to
    create, i.e. one that does not exist when Hydra starts the run or the sweep, with the topmost
    of its parents that does not exist either; :func:`remove_unfinished_runs` reads the notes.
    A directory that exists before (``hydra.run.dir=<existing>``, a resumed run) is never noted."""

    created: ClassVar[list[tuple[Path, Path, bool]]] = []
    """(directory, its topmost new parent or itself, is a sweep) of this process."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._note(Path(str(config.hydra.run.dir)), sweep=False)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._note(Path(str(config.hydra.sweep.dir)), sweep=True)

    @classmethod
    def _note(cls, directory: Path, sweep: bool) -> None:
        directory = directory.absolute()
        if directory.exists():
            return
        top = directory
        while not top.parent.exists():
            top = top.parent
        cls.created.append((directory, top, sweep))


def has_results(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds what makes a run directory worth keeping after a failure: what
    fedst.training.run_training writes once a round has run (the server's training row, an
    evaluation row, the round's checkpoint) and at the end. Before the first round it writes only
    setup files (device.jsonl, config.json, benchmark.json, iid_partition.json, log.txt; Hydra
    its .hydra/ and job log)."""
    from fedst.runs.layout import FINAL_JSON, METRICS_JSONL, TRAIN_JSONL

    return any(
        (run_dir / name).exists()
        for name in ("checkpoints", METRICS_JSONL, TRAIN_JSONL, FINAL_JSON)
    )


def remove_unfinished_runs() -> list[Path]:
    """After a failed invocation, remove the run directories it created that hold no results.

    The rule: a run directory Hydra created for this invocation (:class:`NewRunDirectories`;
    never one that existed before, so never a resumed run or a ``hydra.run.dir`` given) is
    removed when the run has not written results (:func:`has_results`): a config, data or
    setup error, or an interruption before the first round ended, leaves nothing behind. Its
    parents this invocation created go too when they are left empty (a first run's ``runs/``).
    A sweep (``-m``) is handled job by job: a job directory without results goes, and the sweep
    directory too once it holds nothing but Hydra's multirun.yaml. Returns what was removed."""
    removed: list[Path] = []
    for directory, top, sweep in NewRunDirectories.created:
        if not directory.is_dir():
            continue
        if sweep:
            for job in [p for p in directory.iterdir() if p.is_dir() and not has_results(p)]:
                shutil.rmtree(job)
                removed.append(job)
            if any(p.name != "multirun.yaml" for p in directory.iterdir()):
                continue
        elif has_results(directory):
            continue
        shutil.rmtree(directory)
        removed.append(directory)
        while directory != top:  # the parents this invocation created, once empty
            directory = directory.parent
            if any(directory.iterdir()):
                break
            directory.rmdir()
            removed.append(directory)
    NewRunDirectories.created.clear()
    return removed


_KEPT_FAILURES: list[Exception] = []
"""The failure of this process's Hydra job, kept by :func:`hydra_job` (at most one)."""


@contextlib.contextmanager
def hydra_job() -> Iterator[None]:
    """The body of a ``@hydra.main`` function. A failure of a single run is kept and raised by
    :func:`run_hydra_entry_point` once Hydra has returned: raised into Hydra, it would first print
    "Error executing job with overrides: [...]" (hydra/core/utils.py ``JobReturn.return_value``),
    a second line. In a sweep (``-m``) that line names the job that failed, so it is kept."""
    try:
        yield
    except Exception as err:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            raise
        _KEPT_FAILURES.append(err)


def run_hydra_entry_point(
    main: Callable[[], object],
    program: str,
    config_name: str,
    keys_listed: str,
    groups: bool = True,
    after_interrupt: Callable[[], str] | None = None,
) -> NoReturn:
    """:func:`fedst.errors.run_entry_point` for a ``@hydra.main`` function whose body runs in
    :func:`hydra_job`: a failure first removes the run directories this invocation created that
    hold no results (:func:`remove_unfinished_runs`), and Hydra's composition errors become one
    line (:func:`hydra_config_error`; ``keys_listed`` says where every key is listed).
    ``after_interrupt``: what follows "interrupted" after Ctrl-C (run_entry_point)."""

    def guarded() -> object:
        try:
            status = main()
            if _KEPT_FAILURES:
                failure = _KEPT_FAILURES.pop()
                _KEPT_FAILURES.clear()
                raise failure
            return status
        except BaseException as err:
            if not (isinstance(err, SystemExit) and err.code in (None, 0)):
                remove_unfinished_runs()
            if isinstance(err, ConfigCompositionException):
                reworded = hydra_config_error(err, config_name, keys_listed, groups)
                if reworded is not None:
                    raise reworded from err
            raise

    run_entry_point(guarded, program, after_interrupt)

"""Specification: every command the documentation shows is accepted by its entry point.

Commands are collected from README.md, data/README.md, every docs/*.md page, the comments of
configs/**/*.yaml, the studies' pages (studies/*/README.md) and the module docstrings of the Python
sources: ``python train_fed.py ...``, ``python eval_outfed.py ...``, ``python -m fedst.<module> ...``,
``python -m bench.<name> ...`` and ``python -m studies.<study>.<script> ...``. Each is checked without running it: Hydra commands are
composed (unknown keys, groups or ablations fail), argparse commands are parsed by the module's own
parser (and their Hydra overrides composed), ``fedst.data.check`` arguments by its own parser and
data config loader. Synopsis notation is read as a user would: ``[optional]`` parts are included,
``[X ...]`` repetitions and ``...`` dropped, placeholders (DIR, N, <time>, <name>) filled in.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from fedst.cli import CONFIG_DIR, compose_experiment, register_resolvers

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DRIVERS = {"bench.gpu_check": "bench.gpu_check.check"}
"""``python -m <package>`` -> the module whose ``main(argv)`` its ``__main__`` calls."""
COMMAND = re.compile(
    r"python (?P<prog>train_fed\.py|eval_outfed\.py|-m (?:fedst|bench|studies)(?:\.\w+)+)"
    r"(?P<args>[^`\n#;\"]*)"
)
PLACEHOLDERS = {  # documentation placeholder -> a value a user would type
    "<name>": "table4_row2_ts",
    "<time>": "20260101-000000",
    "<sweep dir>": "multirun/demo/20260101-000000",
    "<run>": "runs/demo/fedst_s0_20260101-000000",
    "configs/data/my_sites.yaml": "configs/data/tiny.yaml",
    "<host>": "fedst-server.example.org",
    "<site port>": "49413",
    "method=<m>": "method=fedavg",
    "<demo data>": "data/procedural/demo_v2",
    "[overrides] ": "",  # an override list written as a word (studies/outfed_e)
    "OVERRIDES ": "",
    "--runs ...": "--runs runs/x",
    "<override>": "network.temporal_position_bias=free",
}
TOKENS = {
    "DIR": "some/dir",
    "RUN": "runs/demo/x",
    "ROW": "oracle_x1",
    "RUN_DIR": "runs/demo/x",
    "N": "0",
    "NAME:SURGERY": "A:nephrectomy",
}


def _documents() -> dict[str, str]:
    """Source name -> documentation text (Markdown files, YAML comments, module docstrings)."""
    pages = [
        "README.md",
        "data/README.md",
        *(str(p.relative_to(REPO)) for p in sorted(REPO.glob("docs/*.md"))),
        *(str(p.relative_to(REPO)) for p in sorted(REPO.glob("studies/*/README.md"))),
    ]
    texts = {name: (REPO / name).read_text() for name in pages}
    for path in sorted((REPO / "configs").rglob("*.yaml")):  # comments only
        lines = path.read_text().splitlines()
        texts[str(path.relative_to(REPO))] = "\n".join(
            line.split("#", 1)[1] for line in lines if "#" in line
        )
    sources = [REPO / "train_fed.py", REPO / "eval_outfed.py", *sorted(REPO.glob("fedst/**/*.py"))]
    for path in sources + sorted(REPO.glob("bench/*.py")) + sorted(REPO.glob("studies/*/*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text()))
        if docstring:
            texts[str(path.relative_to(REPO))] = docstring
    return texts


def _normalise(args: str) -> list[str]:
    """Synopsis -> a concrete argument list."""
    for placeholder, value in PLACEHOLDERS.items():
        args = args.replace(placeholder, value)
    args = re.sub(r"(^|\s)\[[^\[\]]*\.\.\.[^\[\]]*\]", " ", " " + args)  # [X ...] repetitions
    args = re.sub(r"(^|\s)\[([^\[\]]*)\]", r" \2", args)  # [optional] -> included
    tokens = []
    for token in shlex.split(args):
        token = token.removesuffix("...")
        if token:
            tokens.append(TOKENS.get(token, token))
    return tokens


def _join_code_spans(text: str) -> str:
    """An inline code span that Markdown wraps over lines is one command: its lines joined (fenced
    blocks are left as they are: each of their lines is a command)."""
    parts = re.split(r"(^[ \t]*```.*?^[ \t]*```)", text, flags=re.MULTILINE | re.DOTALL)
    for index in range(0, len(parts), 2):
        parts[index] = re.sub(
            r"`[^`]+`", lambda span: re.sub(r"\s*\n\s*", " ", span[0]), parts[index]
        )
    return "".join(parts)


def documented_commands() -> list[tuple[str, str, list[str]]]:
    found = {}
    for source, text in _documents().items():
        text = re.sub(r"\\\n\s*", " ", text)  # a shell line continuation joins its lines
        if source.endswith(".md"):
            text = _join_code_spans(text)
        for match in COMMAND.finditer(text):
            prog = match["prog"].removeprefix("-m ")
            args = _normalise(match["args"])
            found.setdefault((prog, tuple(args)), source)
    return [(source, prog, list(args)) for (prog, args), source in found.items()]


COMMANDS = documented_commands()


def scripts() -> list[str]:
    """The dotted names of the scripts of bench/ and studies/ (a file that runs as ``__main__``)."""
    files = [
        *sorted(REPO.glob("bench/*.py")),
        *sorted(REPO.glob("bench/gpu_check/*.py")),
        *sorted(REPO.glob("studies/*/*.py")),
    ]
    names = [".".join(f.relative_to(REPO).with_suffix("").parts) for f in files]
    return [
        name
        for name, path in zip(names, files, strict=True)
        if 'if __name__ == "__main__"' in path.read_text()
    ]


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


def _hydra_overrides(args: list[str]) -> list[str]:
    """Drop -m; a multirun sweep a,b,c is checked with its first value. Hydra's own --help is
    not an override (tests/test_cli_help.py checks what it prints)."""
    args = [a for a in args if a != "--help"]
    if "-m" not in args and "--multirun" not in args:
        return args
    kept = [a for a in args if a not in ("-m", "--multirun")]
    return [a.split(",")[0] if "=" in a and "[" not in a else a for a in kept]


def _check_argparse_module(module_name: str, args: list[str], monkeypatch) -> None:
    module = importlib.import_module(PACKAGE_DRIVERS.get(module_name, module_name))
    if "--help" in args or "-h" in args:
        with pytest.raises(SystemExit) as exited:
            module.main(args)
        assert exited.value.code == 0, module_name
        return
    original, original_known = (
        argparse.ArgumentParser.parse_args,
        argparse.ArgumentParser.parse_known_args,
    )

    def parse_then_stop(self, argv=None, namespace=None):
        monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", original_known)
        raise _Parsed(original(self, argv, namespace))

    def parse_known_then_stop(self, args=None, namespace=None):  # a driver passing the rest on
        raise _Parsed(original_known(self, args, namespace)[0])

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_then_stop)
    with pytest.raises(_Parsed) as parsed:
        module.main(args)
    overrides = getattr(parsed.value.namespace, "overrides", None)
    if overrides:
        compose_experiment(list(overrides))


def test_the_documentation_shows_every_entry_point():
    programs = {prog for _, prog, _ in COMMANDS}
    for expected in (
        "train_fed.py",
        "eval_outfed.py",
        "fedst.report",
        "fedst.data.check",
        "fedst.data.stats",
        "fedst.data.procedural",
        "fedst.data.preview",
        "fedst.weights",
        "fedst.preprocess",
        "fedst.demo",
        "fedst.infer",
        "fedst.export",
        "fedst.paper",
        "fedst.guard",
    ):
        assert expected in programs


@pytest.mark.parametrize(
    ("source", "prog", "args"), COMMANDS, ids=[f"{p} {' '.join(a)}" for _, p, a in COMMANDS]
)
def test_every_documented_command_is_accepted(source, prog, args, monkeypatch):
    context = f"{source}: python {prog} {' '.join(args)}"
    if prog == "train_fed.py":
        compose_experiment(_hydra_overrides(args))
    elif prog == "eval_outfed.py":
        register_resolvers()
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("eval_outfed", overrides=args)
        assert cfg.run, context
    elif prog == "fedst.data.check":
        from fedst.data import check

        values = check.parse_arguments(args)
        config = check.load_data_config(values.get("data", "paper"))
        assert values.get("site", next(iter(config.sites))) in config.sites, context
        int(values.get("max_frames", 0))
    elif prog == "fedst.data.stats":
        from fedst.data import check, stats

        values = check.parse_arguments(args, stats.ARGUMENTS)
        config = check.load_data_config(values.get("data", "paper"))
        assert values.get("site", next(iter(config.sites))) in config.sites, context
        int(values.get("sample_frames", 0))
    elif prog in ("fedst.infer", "fedst.export"):  # key=value into the command's typed config
        from fedst import export, infer

        config_class = infer.InferConfig if prog == "fedst.infer" else export.ExportConfig
        infer.parse_key_values(config_class, args)
    else:
        _check_argparse_module(prog, args, monkeypatch)


@pytest.mark.parametrize("module_name", scripts())
def test_every_bench_and_study_script_answers_help(module_name, capsys):
    module = importlib.import_module(module_name)
    with pytest.raises(SystemExit) as exited:
        module.main(["--help"])
    assert exited.value.code == 0, module_name
    assert "usage:" in capsys.readouterr().out, module_name


def test_every_bench_and_study_script_is_documented_on_its_page():
    """A benchmark in docs/benchmark.md, a study's script in its study's README, as a command."""
    undocumented = []
    for name in scripts():
        page = (
            "docs/benchmark.md"
            if name.startswith("bench.")
            else (f"studies/{name.split('.')[1]}/README.md")
        )
        drivers = {module: package for package, module in PACKAGE_DRIVERS.items()}
        if f"python -m {drivers.get(name, name)}" not in (REPO / page).read_text():
            undocumented.append(f"{name} (not in {page})")
    assert not undocumented, undocumented

"""Specification of the package's layering: no import cycle among the modules of fedst/ and
models/, counting every import anywhere in a file (module level, inside functions, under
``TYPE_CHECKING``), so that the code reads bottom-up: data -> model -> methods / federation ->
apps and engines -> entry points and reports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("fedst", "models")
LAYERS: tuple[tuple[str, ...], ...] = (  # bottom-up; a module may import its own layer and below
    (
        "fedst",
        "fedst.config",
        "fedst.units",
        "fedst.seeding",
        "fedst.accel",
        "fedst.progress",
        "fedst.errors",
        "fedst.storage",
        "fedst.lazy",
        "fedst.schema",  # the config dataclasses and names of the lower packages, torch-free
    ),
    ("models",),
    ("fedst.data",),
    ("fedst.model",),
    ("fedst.experiment",),  # the typed config
    ("fedst.methods",),  # what a method chooses: personalization, objective, aggregation, privacy
    ("fedst.scoring",),  # metrics, per-frame evaluation, a site's data: training and post-run
    ("fedst.runs",),  # a run directory: its layout, files, and the models it returns
    ("fedst.cli", "fedst.weights", "fedst.preprocess"),  # Hydra composition; weights; frame cache
    ("fedst.federation",),  # the algorithm's engine-agnostic pieces: sites, server, SERQ, transport
    ("fedst.guard",),
    ("fedst.report",),
    ("fedst.app",),  # the Flower ServerApp and ClientApp, in-process and Ray engines
    ("fedst.training",),  # train_fed.py's run: prepare, the engine, finalize
    ("fedst.deploy",),  # SuperLink, SuperNodes and the deployed ServerApp
    ("fedst.onnx_stream", "fedst.quantize"),  # the ONNX Runtime engine of the export
    ("fedst.paper", "fedst.demo", "fedst.infer", "fedst.export"),  # entry points
)


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES (a package is its __init__)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that the file of module ``name`` imports anywhere in its text."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # "from fedst.report import plots" names the module fedst.report.plots, "from
            # fedst.report.results import Table" the module fedst.report.results
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.append(submodule if submodule in modules else base)
    found = set()
    for target in targets:
        while target and target not in modules:  # fedst.report.tables.main -> fedst.report.tables
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}  # a -> b -> c -> a; d outside
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from fedst.report import plots\n")
    modules = {"fedst.m": source, "fedst.report.plots": source, "fedst": source}
    assert imported_modules("fedst.m", source, modules) == {"fedst.report.plots"}


def test_no_module_of_fedst_or_models_imports_itself_through_others():
    modules = module_files()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 50 and graph["fedst.training"]  # the whole tree was read
    cycles = import_cycles(graph)
    described = [
        " <-> ".join(cycle)
        + ": "
        + "; ".join(f"{m} imports {sorted(graph[m] & set(cycle))}" for m in cycle)
        for cycle in cycles
    ]
    assert not cycles, "import cycles:\n" + "\n".join(described)


ROOT_PACKAGES = {"fedst"}
"""Names in LAYERS that stand for the package's own ``__init__`` alone: a module under them is
in a layer only where LAYERS names it (or its subpackage). ``models`` is a layer as a whole."""


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest name that is ``module`` or a package above it (a root
    package counts only for itself); a module no name covers is an error."""
    matches = [
        (len(prefix), index)
        for index, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or (prefix not in ROOT_PACKAGES and module.startswith(prefix + "."))
    ]
    assert matches, f"{module} is in no layer: add it to LAYERS in tests/test_layering.py"
    return max(matches)[1]


def test_a_module_no_layer_names_is_an_error_not_the_bottom_layer():
    with pytest.raises(AssertionError, match=r"fedst\.brand_new is in no layer"):
        layer_of("fedst.brand_new")
    assert layer_of("fedst") == 0 and layer_of("fedst.report.tables") == layer_of("fedst.report")


def test_every_module_of_the_tree_is_in_a_layer():
    unplaced = []
    for name in module_files():
        try:
            layer_of(name)
        except AssertionError:
            unplaced.append(name)
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"


def test_the_code_reads_bottom_up_data_model_methods_runtime_apps_entry_points():
    modules = module_files()
    upward = [
        f"{name} (layer {layer_of(name)}) imports {other} (layer {layer_of(other)})"
        for name, path in modules.items()
        for other in sorted(imported_modules(name, path, modules))
        if layer_of(other) > layer_of(name)
    ]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_no_module_imports_another_modules_private_name():
    """``from fedst.x import _y`` across modules is a name that should be public, or should live
    with its one user (tests may reach in; the project's code may not)."""
    modules = module_files()
    found = []
    for path in modules.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                project = node.level > 0 or (node.module or "").split(".")[0] in PACKAGES
                private = [
                    a.name
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
                if project and private:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} imports {private}")
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def test_every_package_says_what_it_holds_and_which_layers_it_may_import():
    packages = sorted(
        path
        for package in PACKAGES
        for path in (REPO / package).rglob("*")
        if path.is_dir() and any(path.glob("*.py")) and path.name != "__pycache__"
    )
    assert len(packages) >= 14
    undocumented = []
    for folder in packages:
        init = folder / "__init__.py"
        docstring = ast.get_docstring(ast.parse(init.read_text())) if init.exists() else None
        if not docstring or "Layer:" not in docstring:
            undocumented.append(str(folder.relative_to(REPO)))
    assert not undocumented, (
        f"packages without an __init__ docstring naming their layer: {undocumented}"
    )

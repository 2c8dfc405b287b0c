"""Counts of how the code is shaped, for issue 35's before/after note.

    python tools/code_shape.py [--root DIR] [--longest N]

Reads the project's source (fedst/, models/, the entry scripts, bench/; tests left out) as text
with ``ast`` and prints:

* functions that take the whole config (a parameter named ``cfg``), and those that take it
  together with ``run_dir``;
* calls of ``method_of``;
* imports of underscore names (``from x import _y``, dunders excepted) from another project
  module;
* the longest functions (lines from ``def`` to the last line of the body).

``duplicates --most 200`` gives the repeated-code pairs; it is a separate tool.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

SOURCE_DIRS = ("fedst", "models", "bench")
ENTRY_SCRIPTS = ("train_fed.py", "eval_outfed.py")
PROJECT_PACKAGES = ("fedst", "models", "bench")


def source_files(root: Path) -> list[Path]:
    files = [root / name for name in ENTRY_SCRIPTS if (root / name).exists()]
    for folder in SOURCE_DIRS:
        files += sorted((root / folder).rglob("*.py"))
    return files


def parameter_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = node.args
    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]


def shape(root: Path) -> dict:
    """Every count of the module docstring, over ``source_files(root)``."""
    takes_cfg, takes_cfg_and_run_dir, method_of_calls, underscore_imports = [], [], [], []
    lengths = []
    for path in source_files(root):
        where = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text(), filename=where)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = parameter_names(node)
                if "cfg" in names:
                    takes_cfg.append(f"{where}:{node.lineno} {node.name}")
                    if "run_dir" in names:
                        takes_cfg_and_run_dir.append(f"{where}:{node.lineno} {node.name}")
                lengths.append(
                    (node.end_lineno - node.lineno + 1, f"{where}:{node.lineno} {node.name}")
                )
            elif isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name == "method_of":
                    method_of_calls.append(f"{where}:{node.lineno}")
            elif isinstance(node, ast.ImportFrom):
                project = node.level > 0 or (node.module or "").split(".")[0] in PROJECT_PACKAGES
                for alias in node.names:
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if project and private:
                        underscore_imports.append(f"{where}:{node.lineno} {alias.name}")
    lengths.sort(reverse=True)
    return {
        "takes_cfg": takes_cfg,
        "takes_cfg_and_run_dir": takes_cfg_and_run_dir,
        "method_of_calls": method_of_calls,
        "underscore_imports": underscore_imports,
        "longest": lengths,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--longest", type=int, default=5)
    parser.add_argument("--list", action="store_true", help="list every place, not only counts")
    args = parser.parse_args(argv)
    counts = shape(args.root)
    files = lambda places: len({p.split(":")[0] for p in places})  # noqa: E731
    for key in ("takes_cfg", "takes_cfg_and_run_dir", "method_of_calls", "underscore_imports"):
        print(f"{key:24s} {len(counts[key]):4d} in {files(counts[key])} files")
        if args.list:
            print("".join(f"    {place}\n" for place in counts[key]), end="")
    print("longest functions:")
    for lines, place in counts["longest"][: args.longest]:
        print(f"    {lines:4d} lines  {place}")


if __name__ == "__main__":
    main()

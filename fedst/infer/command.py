"""The ``fedst.infer`` command's typed config (:class:`InferConfig`), its error
(:class:`InferenceError`), and the ``key=value`` argument parsing and help it shares with
``fedst.export``."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import sys
import textwrap
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fedst.config import build, did_you_mean
from fedst.errors import UserError


class InferenceError(UserError, ValueError):
    """Bad input for inference or export: the message names the file or key and the fix."""


@dataclass(frozen=True)
class InferConfig:
    run: str
    """Run directory written by train_fed.py (holds config.json, checkpoints/, sites/)."""
    site: str
    """A federated site of the run (its personalized model) or "outfed" (the averaged model)."""
    input: str
    """A video file, a folder of frame images (sorted by name), or a camera index (0, 1, ...)."""
    output: str | None = None
    """Output folder (default <run>/infer/<site>_<input name>)."""
    prompt_site: str | None = None
    """site=outfed: the site whose indicator prompts the model (e.g. E); any configured site."""
    fps: float | None = None
    """Frame rate of a frame folder (required there); overrides a video's or camera's own."""
    labels: bool = False
    """Also write each frame's label map as labels/<frame>.png (uint8, 0 background .. 3 jaw)."""
    alpha: float = 0.5
    """Opacity of the class colours in the overlay."""
    max_frames: int | None = None
    """Stop after this many frames (a camera runs until then or Ctrl-C)."""
    device: str = "auto"
    """auto (CUDA when present, else CPU) | cpu | cuda | cuda:N."""
    progress: bool = True
    """Show a progress bar with the running FPS."""
    runtime: str = "torch"
    """torch (PyTorch on device=) | onnx | onnx-int8 (the graph exported by fedst/export.py with
    format=onnx / onnx-int8, run by ONNX Runtime on the CPU); summary.json records it."""
    onnx_file: str | None = None
    """runtime=onnx / onnx-int8: the exported graph (default <run>/export/<site>.onnx or
    <site>.int8.onnx; site=outfed: outfed_<prompt_site>)."""
    threads: int | None = None
    """CPU threads of the network (PyTorch or ONNX Runtime intra-op); default: the library's."""
    realtime: bool = False
    """Read a video file or frame folder at its frame rate, as a camera delivers it: a frame
    that arrives while the pipeline is busy replaces the one waiting (counted as dropped), and
    the end-to-end time runs from a frame's arrival. false: every frame, as fast as possible."""
    warmup_frames: int = 5
    """Frames left out of the latency percentiles (summary.json "latency_ms"): the first
    passes allocate memory and pick kernels."""
    guard: str | None = None
    """dad: the model corrected by GEN-Guard's DAD (fedst/guard/, python -m fedst.guard) instead
    of the last round's: the site's corrected v_k, or for site=outfed the out-of-federation model
    corrected at the held-out site. Its sites/<site>/guard/dad.pt must exist; summary.json names
    it."""


C = TypeVar("C")


def parse_key_values(
    cls: type[C], argv: Sequence[str], doc: str | None = None, prog: str | None = None
) -> C:
    """``key=value`` arguments -> config dataclass ``cls`` (unknown or missing keys are errors).

    Values are read as YAML scalars (``labels=true``, ``fps=25``, ``size=[512,640]``); a field
    typed ``str`` keeps its text (``input=0`` is camera "0"). ``-h`` / ``--help`` prints
    :func:`key_value_help` and exits 0.
    """
    from omegaconf import OmegaConf

    if any(arg in ("-h", "--help") for arg in argv):
        print(key_value_help(cls, doc, prog))
        sys.exit(0)
    bad = [arg for arg in argv if "=" not in arg]
    if bad:
        raise InferenceError(f"arguments are key=value; got {bad}")
    values = OmegaConf.to_container(OmegaConf.from_dotlist(list(argv)))
    hints = typing.get_type_hints(cls)
    for name, value in list(values.items()):
        if hints.get(name) is str or (hints.get(name) == str | None and value is not None):
            values[name] = str(value)
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = [key for key in values if key not in known]
    if unknown:  # before the missing ones: a misspelled required key is both (inptu=)
        raise InferenceError(
            f"{unknown[0]}={values[unknown[0]]}: unknown key{did_you_mean(unknown[0], known)}; "
            f"keys: {', '.join(known)} (see --help)"
        )
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.name not in values
    ]
    if missing:
        raise InferenceError(f"missing required key(s) {missing}; see --help")
    return build(cls, values, cls.__name__)


def key_value_help(cls: type, doc: str | None, prog: str | None, width: int = 100) -> str:
    """Terminal help of a key=value command: a usage line, ``doc`` as written (plain text,
    pre-formatted), then every field of ``cls`` with its default as typed on the command line
    (null, true, [512, 640]) and its docstring re-wrapped."""
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    usage = " ".join([prog or cls.__name__, *(f"{n}={n.upper()}" for n in required)])
    docs = _field_docs(cls)
    keys = []
    for f in dataclasses.fields(cls):
        value = "(required)" if f.name in required else _as_typed(f.default)
        keys.append(f"  {f.name}={value}")
        text = " ".join(docs.get(f.name, "").split())
        keys.append(textwrap.fill(text, width, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(
        [
            f"usage: {usage} [key=value ...]",
            "",
            (doc or "").strip(),
            "",
            "keys (values are YAML: true, 25, null, [512,640]):",
            *keys,
        ]
    )


def _as_typed(value: Any) -> str:
    """A default as it would be typed on the command line (YAML)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple | list):
        return f"[{','.join(_as_typed(v) for v in value)}]"
    return str(value)


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {
        node.target.id: after.value.value
        for node, after in itertools.pairwise(body)
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
    }

"""Loading model files that follow the examples/ convention.

A model file defines, at module level:

- ``PRESETS``: a dict from preset name to a frozen dataclass config; ``"tiny"`` runs in seconds on CPU.
- ``make(preset="tiny", *, abstract=False, seed=0, **overrides) -> (state, batch)``: the example
  train state (params and optimizer state) and one batch. With ``abstract=True`` every leaf is a
  ``jax.ShapeDtypeStruct`` and nothing is allocated. ``overrides`` replace fields of the preset config.
- ``train_step(state, batch) -> (new_state, metrics)``: one ordinary optimisation step.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from autoshard.errors import ExampleError

REPOSITORY_VARIABLE = "AUTOSHARD_REPO"  # where ``repository_root`` looks first: a checkout of autoshard


def repository_root(start: str | Path | None = None) -> Path:
    """The autoshard checkout whose ``examples/`` the notebooks load: ``$AUTOSHARD_REPO`` when set, else the
    first of ``start`` (default: the working directory) and its parents that holds ``examples/gpt.py``,
    else the checkout this ``autoshard`` package was imported from. A notebook converted and run
    elsewhere (``jupyter nbconvert --execute /tmp/tour.ipynb``) runs in another directory, where the
    working directory alone finds nothing."""
    import os

    here = Path.cwd() if start is None else Path(start).resolve()
    env = os.environ.get(REPOSITORY_VARIABLE)
    candidates = [Path(env)] if env else []
    candidates += [here, *here.parents, Path(__file__).resolve().parents[1]]
    for p in candidates:
        if (p / "examples" / "gpt.py").is_file():
            return p
    raise ExampleError(
        f"cannot find autoshard's examples/ (looked in {'$' + REPOSITORY_VARIABLE + ', ' if env else ''}{here} and "
        f"its parents, and beside the autoshard package at {Path(__file__).resolve().parents[1]}): run the "
        f"notebook from a checkout of autoshard, or set {REPOSITORY_VARIABLE}=/path/to/autoshard")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Example:
    name: str
    preset: str
    config: Any
    train_step: Callable[..., Any]
    args: tuple[Any, ...]


def load_module(path: str | Path) -> ModuleType:
    path = Path(path)
    if not path.is_file():
        raise ExampleError(f"model file {str(path)!r} does not exist; pass a path such as examples/gpt.py")
    name = f"autoshard_user_model_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ExampleError(f"cannot import {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    missing = [a for a in ("PRESETS", "make", "train_step") if not hasattr(module, a)]
    if missing:
        raise ExampleError(
            f"{path} lacks {', '.join(missing)}; a model file defines PRESETS, make(preset, abstract=...) "
            "and train_step(state, batch) (see the README's 'Model files' section)"
        )
    return module


def _parse_value(field: dataclasses.Field, current: Any, text: str) -> Any:
    kind = type(current)
    if kind is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ExampleError(f"--set {field.name}={text}: expected true or false")
    if kind in (int, float, str):
        try:
            return kind(text)
        except ValueError:
            raise ExampleError(f"--set {field.name}={text}: expected a {kind.__name__}") from None
    raise ExampleError(f"--set {field.name}: fields of type {kind.__name__} cannot be set from the command line")


def parse_overrides(config: Any, overrides: Sequence[str]) -> dict[str, Any]:
    fields = {f.name: f for f in dataclasses.fields(config)}
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ExampleError(f"--set {item!r}: expected KEY=VALUE")
        if key not in fields:
            raise ExampleError(f"--set {key}: no such config field; fields are {', '.join(fields)}")
        out[key] = _parse_value(fields[key], getattr(config, key), text)
    return out


def load_example(
    path: str | Path, preset: str = "tiny", overrides: Sequence[str] = (), *, abstract: bool = True
) -> Example:
    module = load_module(path)
    presets = module.PRESETS
    if preset not in presets:
        raise ExampleError(f"{path}: no preset {preset!r}; presets are {', '.join(presets)}")
    kw = parse_overrides(presets[preset], overrides)
    state, batch = module.make(preset, abstract=abstract, **kw)
    config = dataclasses.replace(presets[preset], **kw)
    return Example(
        name=Path(path).stem, preset=preset, config=config, train_step=module.train_step, args=(state, batch)
    )

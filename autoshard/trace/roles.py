"""Readable names and roles for the leaves of a train step's arguments and results.

Names follow the function's signature and the pytree path: ``state.params.block_0.attn.kernel``,
``batch.tokens``, ``out[1].loss``. Roles are inferred from the path, the first match winning:

1. a path through a key named ``opt_state`` (optax state, flax ``TrainState``) -> ``Role.OPT_STATE``;
2. a path through ``params`` or ``param`` -> ``Role.PARAM``;
3. an argument named like a batch (``batch``, ``inputs``, ``data``, ``x``, ``y``, ``examples``) or a path
   through a key named ``batch`` -> ``Role.BATCH``;
4. the first argument (the train state) -> ``Role.STATE``; any later argument -> ``Role.BATCH``.

``roles={"state.ema": "param"}`` overrides by path prefix (the longest prefix wins).
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from autoshard.errors import TraceError

_BATCH_ARG_NAMES = frozenset({"batch", "inputs", "data", "x", "y", "examples", "xs"})


class Role(enum.Enum):
    """What a tensor is to the train step. Inputs get theirs from the argument pytrees."""

    PARAM = "param"
    OPT_STATE = "opt_state"
    STATE = "state"  # other carried state: step counters, RNG keys, batch statistics
    BATCH = "batch"
    CONST = "const"  # literals and values closed over by the traced function
    ACTIVATION = "activation"
    OUTPUT = "output"



def _key_str(key: Any) -> str:
    if isinstance(key, jax.tree_util.GetAttrKey):
        return f".{key.name}"
    if isinstance(key, jax.tree_util.DictKey):
        k = key.key
        return f".{k}" if isinstance(k, str) and k.isidentifier() else f"[{k!r}]"
    if isinstance(key, jax.tree_util.SequenceKey):
        return f"[{key.idx}]"
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return f"[{key.key}]"
    return f"[{key}]"


def _key_token(key: Any) -> str | None:
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.DictKey) and isinstance(key.key, str):
        return key.key
    return None


def arg_names(fn: Callable[..., Any], n_args: int) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(n_args):
        if i < len(params) and params[i].kind in (params[i].POSITIONAL_ONLY, params[i].POSITIONAL_OR_KEYWORD):
            names.append(params[i].name)
        elif params and params[-1].kind is params[-1].VAR_POSITIONAL:
            names.append(f"{params[-1].name}[{i - len(params) + 1}]")
        else:
            names.append(f"arg{i}")
    return names


def leaf_name(prefix: str, path: Sequence[Any]) -> str:
    return prefix + "".join(_key_str(k) for k in path)


def infer_role(arg_index: int, arg_name: str, path: Sequence[Any]) -> Role:
    tokens = [_key_token(k) for k in path]
    if "opt_state" in tokens:
        return Role.OPT_STATE
    if "params" in tokens or "param" in tokens:
        return Role.PARAM
    if arg_name in _BATCH_ARG_NAMES or "batch" in tokens:
        return Role.BATCH
    return Role.STATE if arg_index == 0 else Role.BATCH


def parse_role(value: Role | str, where: str) -> Role:
    if isinstance(value, Role):
        return value
    try:
        return Role(value)
    except ValueError:
        valid = ", ".join(r.value for r in Role)
        raise TraceError(f"roles[{where!r}] = {value!r} is not a role; expected one of {valid}") from None


def apply_overrides(names: Sequence[str], roles: list[Role], overrides: Mapping[str, Role | str]) -> None:
    for prefix, value in sorted(overrides.items(), key=lambda kv: len(kv[0])):
        role = parse_role(value, prefix)
        hit = False
        for i, name in enumerate(names):
            if name == prefix or name.startswith(prefix + ".") or name.startswith(prefix + "["):
                roles[i] = role
                hit = True
        if not hit:
            some = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise TraceError(f"roles: the prefix {prefix!r} matches no argument leaf; leaves are named {some}")


def output_aliases(
    in_paths: Sequence[tuple[int, tuple[Any, ...]]],
    out_paths: Sequence[tuple[Any, ...]],
    in_avals: Sequence[Any],
    out_avals: Sequence[Any],
    single_output: bool,
) -> dict[int, int]:
    """Map each result leaf that is the new value of an argument leaf (same path, shape, dtype) to it.

    A train step returning ``(new_state, metrics)`` aliases ``out[0].X`` to ``state.X``; one returning just
    ``new_state`` aliases ``X`` to ``state.X``.
    """
    index = {(a, tuple(map(_key_str, p))): i for i, (a, p) in enumerate(in_paths)}
    out: dict[int, int] = {}
    for o, path in enumerate(out_paths):
        if single_output:
            key = (0, tuple(map(_key_str, path)))
        else:
            if not path or not isinstance(path[0], jax.tree_util.SequenceKey):
                continue
            key = (path[0].idx, tuple(map(_key_str, path[1:])))
        i = index.get(key)
        if i is None:
            continue
        a, b = in_avals[i], out_avals[o]
        if tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype:
            out[o] = i
    return out

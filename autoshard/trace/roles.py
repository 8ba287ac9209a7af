"""Readable names and roles for the leaves of a train step's arguments and results.

Names follow the function's signature and the pytree path: ``state.params.block_0.attn.kernel``,
``batch.tokens``, ``out[1].loss``.

Roles come from what the step does with each leaf (``dataflow`` reads it off the traced jaxpr), so that
users may name their arguments freely (``step(params, opt_state, batch)``, ``step(p, o, ids)``,
``step((p, o), tokens)`` and a flax ``TrainState`` all read alike):

1. a leaf whose new value the step returns (``output_aliases``), that reaches the differentiated
   computation (it is an ancestor of an op of the forward or backward pass), and whose new value depends
   on the backward pass, is a parameter -> ``Role.PARAM``;
2. a leaf returned anew whose new value depends on the backward pass but that the differentiated
   computation never reads (optimizer moments, an EMA of the parameters) -> ``Role.OPT_STATE``;
3. any other leaf returned anew is carried state (step counters, RNG keys, batch statistics, frozen
   parameters passed through) -> ``Role.STATE``;
4. a leaf only consumed is the batch (``Role.BATCH``), unless it cannot be one: a scalar or a PRNG key,
   a leaf of an argument that also carries state, or a leaf whose leading dimension is not the batch's
   (the one most of the consumed-only leaves share) -> ``Role.STATE``; a consumed-only leaf on a
   ``params`` / ``opt_state`` path keeps that name's role (frozen weights passed as their own argument).

Names only break ties: a step with no differentiated computation (an evaluation step, a step with
hand-written gradients) falls back to ``name_role`` (paths through ``opt_state``, ``params``, ``batch``,
the argument's own name included). ``roles={"state.ema": "param"}`` overrides by path prefix (the longest
prefix wins) and ``roles={2: "batch"}`` (what ``batch_argnums=(2,)`` writes) a whole argument by position.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.extend.core import Literal

from autoshard.errors import TraceError
from autoshard.trace import jaxpr_compat as jc

log = logging.getLogger("autoshard")

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


def phase_of(name_stack: str) -> str:
    """The pass an equation belongs to, from its name stack: ``"backward"`` under a ``transpose(...)``,
    ``"forward"`` under a ``jvp(...)``, else ``"other"`` (the optimizer, or code outside any gradient)."""
    return "backward" if "transpose(" in name_stack else ("forward" if "jvp(" in name_stack else "other")


def name_role(arg_index: int, arg_name: str, path: Sequence[Any]) -> Role:
    """The role a leaf's name suggests, the first match winning: a path (the argument's own name and its
    ``_``-separated words counted) through ``opt_state`` -> optimizer state; through ``params``/``param`` -> parameter; an argument named
    like a batch or a path through ``batch`` -> batch; the first argument -> state; a later one -> batch."""
    tokens = [arg_name, *arg_name.split("_"), *(_key_token(k) for k in path)]  # frozen_params: params
    if "opt_state" in tokens:
        return Role.OPT_STATE
    if "params" in tokens or "param" in tokens:
        return Role.PARAM
    if arg_name in _BATCH_ARG_NAMES or "batch" in tokens:
        return Role.BATCH
    return Role.STATE if arg_index == 0 else Role.BATCH


# ---- what the step does with each leaf --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Flow:
    """What ``dataflow`` reads off a step's jaxpr. ``differentiates``: the step has a forward or backward
    pass at all; ``reaches_grad[i]``: input ``i`` is an ancestor of an op of either pass;
    ``after_backward[o]``: output ``o`` depends on an op of the backward pass."""

    differentiates: bool
    reaches_grad: tuple[bool, ...]
    after_backward: tuple[bool, ...]


def _contains_phase(closed: Any, memo: dict[int, frozenset[str]]) -> frozenset[str]:
    """The passes (forward, backward) whose ops a body holds, nested bodies included."""
    key = id(closed)
    if key not in memo:
        memo[key] = frozenset()  # a body reached again while being read (recursion guard)
        found: set[str] = set()
        for eqn in closed.jaxpr.eqns:
            p = phase_of(str(eqn.source_info.name_stack))
            if p != "other":
                found.add(p)
            for sub in jc.sub_jaxprs(eqn.params):
                found |= _contains_phase(sub, memo)
        memo[key] = frozenset(found)
    return memo[key]


def dataflow(closed: Any) -> Flow:
    """Walk a closed jaxpr once, inlining calls as the tracer does, carrying for every value the set of
    inputs it descends from (a bit set) and whether it depends on the backward pass."""
    n_in = len(closed.jaxpr.invars)
    memo: dict[int, frozenset[str]] = {}
    reach = 0  # bit set of the inputs that are ancestors of forward/backward ops
    seen_diff = False

    def read(env: dict[Any, tuple[int, bool]], v: Any) -> tuple[int, bool]:
        return (0, False) if isinstance(v, Literal) else env.get(v, (0, False))

    def walk(jaxpr: Any, env: dict[Any, tuple[int, bool]], outer_phase: str) -> None:
        nonlocal reach, seen_diff
        for eqn in jaxpr.eqns:
            ins = [read(env, v) for v in eqn.invars]
            phase = phase_of(str(eqn.source_info.name_stack))
            if phase == "other":
                phase = outer_phase
            body = jc.inline_body(eqn)
            if body is not None:
                sub_env = {cv: (0, False) for cv in body.jaxpr.constvars}
                sub_env.update(zip(body.jaxpr.invars, ins, strict=True))
                walk(body.jaxpr, sub_env, phase)
                for v, ov in zip(eqn.outvars, body.jaxpr.outvars, strict=True):
                    env[v] = read(sub_env, ov)
                continue
            phases = {phase} - {"other"}
            for sub in jc.sub_jaxprs(eqn.params):
                phases |= _contains_phase(sub, memo)
            anc = 0
            for a, _ in ins:
                anc |= a
            after = "backward" in phases or any(b for _, b in ins)
            if phases:
                seen_diff = True
                reach |= anc
            for v in eqn.outvars:
                env[v] = (anc, after)

    env = {cv: (0, False) for cv in closed.jaxpr.constvars}
    env.update({v: (1 << i, False) for i, v in enumerate(closed.jaxpr.invars)})
    walk(closed.jaxpr, env, "other")
    outs = tuple(read(env, v)[1] for v in closed.jaxpr.outvars)
    return Flow(differentiates=seen_diff, reaches_grad=tuple(bool(reach >> i & 1) for i in range(n_in)),
                after_backward=outs)


# ---- which results are the new values of which arguments --------------------------------------------------


def _nodes(tree: Any, path: tuple[Any, ...], start: int, out: list[tuple[tuple[Any, ...], int, int, Any]]) -> int:
    """Every node of ``tree`` (depth first, the root first) as (path, first leaf index, leaf count,
    treedef); returns the next leaf index."""
    treedef = jax.tree_util.tree_structure(tree)
    n = treedef.num_leaves
    out.append((path, start, n, treedef))
    if treedef.num_nodes > 1 and n:  # not a leaf: its children, one level down
        children = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]
        at = start
        for p, child in children:
            at = _nodes(child, path + tuple(p), at, out)
    return start + n


def output_aliases(
    in_paths: Sequence[tuple[int, tuple[Any, ...]]],
    out_paths: Sequence[tuple[Any, ...]],
    in_avals: Sequence[Any],
    out_avals: Sequence[Any],
    single_output: bool,
    args: tuple[Any, ...] | None = None,
    out_shape: Any = None,
) -> dict[int, int]:
    """Map each result leaf that is the new value of an argument leaf to it.

    First by path: a step returning ``(new_state, metrics)`` aliases ``out[0].X`` to ``state.X``; one
    returning just ``new_state`` aliases ``X`` to ``state.X``. Then, given the pytrees (``args`` and
    ``out_shape``), by structure for the arguments left: an argument (or, failing that, each of its
    sub-trees in turn) whose pytree structure, shapes and dtypes one result sub-tree alone repeats, as in
    ``step(params, opt_state, batch) -> (loss, params, opt_state)`` or ``step((p, o), x) -> (p, o, loss)``.
    """

    def same(i: int, o: int) -> bool:
        a, b = in_avals[i], out_avals[o]
        return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype

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
        if i is not None and same(i, o):
            out[o] = i
    if args is None or out_shape is None:
        return out
    outs: list[tuple[tuple[Any, ...], int, int, Any]] = []
    _nodes(out_shape, (), 0, outs)
    ins: list[tuple[tuple[Any, ...], int, int, Any]] = []
    at = 0
    for a, arg in enumerate(args):
        at = _nodes(arg, (a,), at, ins)
    taken_in, taken_out = set(out.values()), set(out)
    # the largest sub-trees first: an optimizer state matched whole takes its moments, which repeat the
    # parameters' structure, out of the running before the parameters look for their match
    for path, start, n, treedef in sorted(ins, key=lambda x: (-x[2], x[1])):
        if n < 2 or any(i in taken_in for i in range(start, start + n)):
            continue  # a lone array matched by shape alone could be a prediction shaped like its input
        found = [(abs(len(p) - len(path)), s) for p, s, m, td in outs
                 if m == n and td == treedef and not any(o in taken_out for o in range(s, s + m))
                 and all(same(start + k, s + k) for k in range(n))]
        if not found:
            continue
        best = min(d for d, _ in found)
        nearest = [s for d, s in found if d == best]
        if len(nearest) != 1:
            continue
        for k in range(n):
            out[nearest[0] + k] = start + k
            taken_out.add(nearest[0] + k)
            taken_in.add(start + k)
    return out


# ---- roles ------------------------------------------------------------------------------------------------


def _is_key(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def infer_roles(
    in_paths: Sequence[tuple[int, tuple[Any, ...]]],
    names_of_args: Sequence[str],
    in_avals: Sequence[Any],
    flow: Flow,
    aliases: Mapping[int, int],
) -> list[Role]:
    """Each argument leaf's role, from the dataflow (the rules in this module's docstring)."""
    if not flow.differentiates:
        return [name_role(a, names_of_args[a], p) for a, p in in_paths]
    anew = {i: flow.after_backward[o] for o, i in aliases.items()}
    carrying = {in_paths[i][0] for i in anew}  # arguments with a leaf returned anew
    roles: list[Role | None] = []
    for i, (a, p) in enumerate(in_paths):
        if i in anew:
            after = anew[i]
            roles.append(Role.PARAM if after and flow.reaches_grad[i] else Role.OPT_STATE if after else Role.STATE)
        elif not getattr(in_avals[i], "shape", ()) or _is_key(in_avals[i]) or a in carrying:
            roles.append(Role.STATE)
        elif (by_name := name_role(a, names_of_args[a], p)) in (Role.PARAM, Role.OPT_STATE):
            roles.append(by_name)
        else:
            roles.append(None)  # the batch, if its leading dimension is the batch's
    rows = Counter(in_avals[i].shape[0] for i, r in enumerate(roles) if r is None)
    if rows:
        batch = max(rows, key=lambda n: (rows[n], n))
        for i, r in enumerate(roles):
            if r is None:
                roles[i] = Role.BATCH if in_avals[i].shape[0] == batch else Role.STATE
    return [r for r in roles if r is not None]


def parse_role(value: Role | str, where: str) -> Role:
    if isinstance(value, Role):
        return value
    try:
        return Role(value)
    except ValueError:
        valid = ", ".join(r.value for r in Role)
        raise TraceError(f"roles[{where!r}] = {value!r} is not a role; expected one of {valid}") from None


def apply_overrides(names: Sequence[str], roles: list[Role], overrides: Mapping[str | int, Role | str],
                    arg_of: Sequence[int] | None = None) -> None:
    """Overwrite ``roles`` in place: a string key is a path prefix (the longest wins), an int key an
    argument's position (``arg_of[i]`` is leaf ``i``'s argument); position keys apply first."""
    for key, value in sorted(overrides.items(), key=lambda kv: (isinstance(kv[0], str), len(str(kv[0])))):
        role = parse_role(value, str(key))
        if isinstance(key, int):
            hits = [i for i, a in enumerate(arg_of or ()) if a == key]
            if not hits:
                n = max(arg_of or (-1,)) + 1
                raise TraceError(f"roles: argument {key} is not an argument of the step (it takes {n} "
                                 f"argument(s) with array leaves); number the arguments from 0")
        else:
            hits = [i for i, name in enumerate(names)
                    if name == key or name.startswith(key + ".") or name.startswith(key + "[")]
            if not hits:
                some = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
                raise TraceError(f"roles: the prefix {key!r} matches no argument leaf; leaves are named {some}")
        for i in hits:
            roles[i] = role


def with_batch_argnums(roles: Mapping[str | int, Any] | None,
                       batch_argnums: Sequence[int] | int | None) -> dict[str | int, Any] | None:
    """``roles`` with every argument in ``batch_argnums`` marked the batch (``roles`` keeps the last word
    on any leaf it names by path)."""
    if batch_argnums is None:
        return dict(roles) if roles else None
    nums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    for n in nums:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise TraceError(f"batch_argnums holds {n!r}; expected argument positions (ints from 0)")
    return {**dict.fromkeys(nums, "batch"), **(roles or {})}

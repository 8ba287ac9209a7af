"""flax nnx steps written as flax teaches them, run as ``nnx.jit`` runs them.

flax's guide writes a train step that takes its objects and updates them in place::

    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

autoshard, like ``jax.jit``, compiles a pure function of arrays. ``nnx.jit`` bridges the two, and so does
this module, for ``parallelize`` and ``plan``:

1. ``split``: the arguments that hold nnx objects (a Module, an Optimizer, Rngs, or a list, tuple or dict
   of them; not a Variable or a State alone, which are pytrees of arrays) are split together,
   ``graphdef, state = nnx.split((model, optimizer))``, so an object two arguments reach (a model its
   optimizer refers to) is one object with one state, under the first argument that reaches it. Each such
   argument is replaced by its ``State``; the other arguments (the batch) are passed as they are.
2. ``NnxCall.step``, the pure function traced and compiled: merge the states into fresh objects, call the
   user's step on them, and return ``(*new_states, result)``: in the place of each nnx argument its new
   state, with the pytree structure of its input (``state in, state out``: ``out[i]`` is the new value of
   argument ``i``, which is how the tracer reads which leaves the step carries), ``None`` in the place of
   the other arguments, and last the step's own result.
3. ``NnxCall.finish``: write the new states into the caller's objects (``nnx.update``) and return the
   step's result. An object the step returns is returned as the caller's own object.

All of each object's state is carried through the program and written back, changed or not. Like the
functional form, the state's old arrays are donated to the program (updated in place): keep a copy
(``jax.tree.map(jnp.copy, nnx.state(model))``) of a state you want to read after later steps.

Only nnx state is carried: a step that changes anything else about its objects (a plain Python attribute,
a new sub-module or Variable, a Variable's metadata) changes their graphdef, which ``nnx.jit`` answers by
tracing again at every call and autoshard, which plans and compiles once, refuses (``TraceError``), naming
what changed.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax

from autoshard.errors import TraceError


def _is_node(x: Any) -> bool:
    """An nnx object: a graph node (Module, Optimizer, Rngs...) other than a Variable. A Variable alone is
    a pytree of its value, as in the ``State`` of the functional form, whose Variables are not updated."""
    nnx = sys.modules["flax.nnx"]
    if isinstance(x, nnx.Variable):
        return False
    is_graph_node = getattr(getattr(nnx, "graph", None), "is_graph_node", None)
    if is_graph_node is not None:
        return bool(is_graph_node(x))
    base = getattr(nnx, "Pytree", None) or getattr(nnx, "Object", None)
    return base is not None and isinstance(x, base)


def holds_nnx(args: tuple[Any, ...]) -> bool:
    """Whether any argument holds a flax nnx object (a Module, an Optimizer, Rngs...)."""
    if "flax.nnx" not in sys.modules:  # never imported: no nnx object can exist
        return False
    return any(_is_node(x) for x in jax.tree_util.tree_leaves(args, is_leaf=_is_node))


def _arg_names(fn: Callable[..., Any], n: int) -> list[str]:
    import inspect

    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"argument {i}" for i in range(n)]


def _nnx_positions(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[int, ...]:
    """The positions of the arguments that hold nnx objects; an argument that mixes them with other leaves
    (arrays, numbers) is refused: only nnx state is written back, so those leaves would silently not be."""
    positions = []
    for i, arg in enumerate(args):
        leaves = jax.tree_util.tree_leaves(arg, is_leaf=_is_node)
        nodes = [x for x in leaves if _is_node(x)]
        if not nodes:
            continue
        if len(nodes) != len(leaves):
            other = next(x for x in leaves if not _is_node(x))
            name = _arg_names(fn, len(args))[i]
            kinds = ", ".join(sorted({type(n).__name__ for n in nodes}))
            raise TraceError(
                f"argument {i} ({name}) holds flax nnx objects ({kinds}) beside other values (a "
                f"{type(other).__name__}); autoshard runs an nnx step as nnx.jit does, writing the new nnx "
                "state back into the objects, and cannot tell what to do with the others: pass the nnx "
                "objects and the arrays as separate arguments, or make the arrays nnx.Variables of a Module")
        positions.append(i)
    return tuple(positions)


@dataclasses.dataclass(frozen=True, slots=True)
class _Returned:
    """In the program's result, an nnx object the step returned that it was given: ``path`` from the
    split arguments (as ``nnx.graph.iter_graph`` walks them) to it. No leaves: it crosses the program as
    pytree structure and ``finish`` puts the caller's own object in its place."""

    path: tuple[Any, ...]


jax.tree_util.register_pytree_node(_Returned, lambda r: ((), r.path), lambda path, _: _Returned(path))


def _walk(nodes: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """Every (path, value) of an object graph, as nnx walks it (each object once)."""
    nnx = sys.modules["flax.nnx"]
    iter_graph = getattr(nnx, "iter_graph", None) or nnx.graph.iter_graph
    return list(iter_graph(nodes))


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Functional:
    """The pure form of one nnx step for one graph of objects (``graphdef``, the nnx arguments at
    ``positions``): ``step`` is what autoshard traces and compiles, the same function object for every
    call on objects of this graph, so that the compiled program is found again."""

    fn: Callable[..., Any]
    graphdef: Any
    positions: tuple[int, ...]
    n_args: int
    step: Callable[..., Any] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        @functools.wraps(self.fn)  # the user's name and signature: leaves are named after its arguments
        def step(*args: Any) -> tuple[Any, ...]:
            return self._run(args)

        object.__setattr__(self, "step", step)

    def matches(self, fn: Callable[..., Any], graphdef: Any, positions: tuple[int, ...], n_args: int) -> bool:
        return (self.fn is fn and self.positions == positions and self.n_args == n_args
                and self.graphdef == graphdef)

    def _run(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        nnx = sys.modules["flax.nnx"]
        state = nnx.State({k: args[i] for k, i in enumerate(self.positions)})
        nodes = nnx.merge(self.graphdef, state)
        call = list(args)
        for k, i in enumerate(self.positions):
            call[i] = nodes[k]
        result = self.fn(*call)
        graphdef, new = nnx.split(nodes)
        if graphdef != self.graphdef:
            raise TraceError(self._changed(nnx.merge(self.graphdef, state), nodes))
        out: list[Any] = [None] * self.n_args
        for k, i in enumerate(self.positions):
            out[i] = new[k]
        return (*out, self._mark_returned(result, nodes))

    def _display(self, path: tuple[Any, ...]) -> str:
        name = _arg_names(self.fn, self.n_args)[self.positions[path[0]]]
        return name + "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in path[1:])

    def _mark_returned(self, result: Any, nodes: tuple[Any, ...]) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(result, is_leaf=_is_node)
        if not any(_is_node(x) for x in leaves):
            return result
        where = {id(node): path for path, node in _walk(nodes) if _is_node(node)}
        marked = []
        for x in leaves:
            if _is_node(x):
                if id(x) not in where:
                    raise TraceError(
                        f"{getattr(self.fn, '__name__', 'the step')} returns a flax nnx {type(x).__name__} "
                        "that it created: autoshard returns arrays from the compiled program and writes nnx "
                        "state back only into the objects the step was given. Return its state "
                        "(nnx.state(obj)) and merge it outside, or create the object outside the step and "
                        "pass it in")
                x = _Returned(where[id(x)])
            marked.append(x)
        return jax.tree_util.tree_unflatten(tree, marked)

    def _changed(self, before: tuple[Any, ...], after: tuple[Any, ...]) -> str:
        """What the step changed about its objects besides their nnx state, for the error."""
        variable = sys.modules["flax.nnx"].Variable

        def described(nodes: tuple[Any, ...]) -> dict[tuple[Any, ...], Any]:
            """Each path's plain value, or only the kind of an object, a Variable or an array (state)."""
            out = {}
            for path, value in _walk(nodes):
                if not path or any(isinstance(p, str) and p.startswith("_pytree__") for p in path):
                    continue
                state = _is_node(value) or isinstance(value, variable) or hasattr(value, "shape")
                out[path] = _Kind(type(value).__name__) if state else value
            return out

        was, now = described(before), described(after)
        changes = []
        for path in sorted(set(was) | set(now), key=str):
            if path not in now:
                changes.append(f"{self._display(path)} removed")
            elif path not in was:
                changes.append(f"{self._display(path)} added (a {_kind(now[path])})")
            elif not _same(was[path], now[path]):
                changes.append(f"{self._display(path)} changed from {was[path]!r} to {now[path]!r}")
        what = "; ".join(changes[:4]) + ("; ..." if len(changes) > 4 else "") if changes else (
            "the structure of its objects or their Variables' metadata")
        return (f"{getattr(self.fn, '__name__', 'the step')} changes its flax nnx objects beyond their "
                f"nnx state ({what}): that is the objects' structure (their graphdef), not arrays a compiled "
                "program can carry, so every call would need a new trace, plan and compile (nnx.jit traces "
                "such a step again at every call). Keep values that change from step to step in "
                "nnx.Variables (e.g. self.count = nnx.Variable(jnp.array(0)); "
                "self.count[...] += 1), and make sub-modules and Variables in __init__, outside the step")


@dataclasses.dataclass(frozen=True, slots=True)
class _Kind:
    name: str

    def __repr__(self) -> str:
        return self.name


def _kind(value: Any) -> str:
    return value.name if isinstance(value, _Kind) else type(value).__name__


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a value whose == is no truth value (an array): changed unless the same object
        return False


@dataclasses.dataclass(frozen=True, slots=True)
class NnxCall:
    """One call of an nnx step taken apart: ``step(*args)`` is the pure function to run, ``finish`` puts
    its result back into the caller's objects."""

    functional: Functional
    args: tuple[Any, ...]
    objects: tuple[Any, ...]  # the caller's nnx arguments, in order

    @property
    def step(self) -> Callable[..., Any]:
        return self.functional.step

    def finish(self, result: tuple[Any, ...]) -> Any:
        """Write the program's new states into the caller's objects; return the step's own result."""
        nnx = sys.modules["flax.nnx"]
        *states, out = result
        positions = self.functional.positions
        nnx.update(self.objects, nnx.State({k: states[i] for k, i in enumerate(positions)}))
        leaves, tree = jax.tree_util.tree_flatten(out, is_leaf=lambda x: isinstance(x, _Returned))
        if not any(isinstance(x, _Returned) for x in leaves):
            return out
        where = dict(_walk(self.objects))
        return jax.tree_util.tree_unflatten(
            tree, [where[x.path] if isinstance(x, _Returned) else x for x in leaves])


def split(fn: Callable[..., Any], args: tuple[Any, ...], known: Sequence[Functional] = ()) -> NnxCall:
    """``fn(*args)``, a step given nnx objects, as a pure step and its arguments (steps 1 and 2 of the
    module docstring). ``known``: the Functionals of earlier calls; one for the same graph is reused (its
    ``step`` is the function the compiled program was made for), else the call holds a new one."""
    nnx = sys.modules["flax.nnx"]
    positions = _nnx_positions(fn, args)
    objects = tuple(args[i] for i in positions)
    graphdef, state = nnx.split(objects)
    functional = next((f for f in known if f.matches(fn, graphdef, positions, len(args))), None)
    if functional is None:
        functional = Functional(fn, graphdef, positions, len(args))
    call_args = list(args)
    for k, i in enumerate(positions):
        call_args[i] = state[k]
    return NnxCall(functional, tuple(call_args), objects)

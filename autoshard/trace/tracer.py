"""Trace a train step into a ``Graph``: ``jax.make_jaxpr``, then one walk over the equations.

What the walk does with each kind of equation:

- nested ``jit``/``pjit``, ``closed_call``, ``custom_jvp_call``, ``custom_vjp_call``: inlined; their
  equations join the enclosing graph (their scope is prefixed with the call site's). The custom
  differentiation rules are no longer needed: the step is already differentiated when it is traced.
- ``scan``: one op whose body is a Graph of its own, with ``trip_count = length`` (a layer stack made
  by ``nn.scan`` stays one op, not L copies).
- ``while``: one op with bodies ``(cond, body)``; ``trip_count`` is known for counter loops
  (``i < N`` with a literal start and step 1), else None and the body is counted once.
- ``cond``: one op with one body per branch; its flops are the largest branch's.
- ``checkpoint`` (remat): one op with its body, kept as a unit so the planner can price recomputation.
- other primitives carrying jaxprs (``shard_map``, ``custom_linear_solve``, ...): one op with those bodies.
- everything else: one op; flops from ``costs.FLOP_RULES``; a primitive with no rule counts 0 flops and
  is logged once per process (``autoshard.trace.unruled``).

Every param that says where a body is or how a call's operands are laid out is read through
``autoshard.trace.jaxpr_compat``, which knows jax 0.10's and 0.11's layouts.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from autoshard.errors import TraceError
from autoshard.trace import jaxpr_compat as jc
from autoshard.trace import roles as _roles
from autoshard.trace import unruled
from autoshard.trace.costs import op_flops
from autoshard.trace.graph import Graph, Op, Role, Tensor, links
from autoshard.trace.structure import tag_blocks

_INHERITED_ROLES = frozenset({Role.PARAM, Role.OPT_STATE, Role.BATCH, Role.STATE, Role.CONST})
_WRAPPER = re.compile(r"[A-Za-z_][\w]*\(([^()]*)\)")

try:  # source locations; jax keeps these helpers private, so degrade to "" if they move
    from jax._src import source_info_util as _siu
except ImportError:  # pragma: no cover
    _siu = None


_LIBRARY_MARKERS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def _source(eqn: Any, call_site: str = "") -> str:
    """The line of the user's code that made this equation: the innermost frame outside installed
    libraries (so a flax Dense reports the model line that called it); else, inside an inlined call, the
    call site's line (jax 0.11 keeps only the frames below a jitted function in its equations, so an
    optax update's equations see optax alone); else the innermost non-JAX frame."""
    if _siu is None:
        return call_site
    first = user = None
    try:  # lazily: each frame costs a lookup, and the user's is usually among the first (70B Llama: 28k eqns)
        for f in _siu.user_frames(eqn.source_info.traceback):
            first = first or f
            if not any(m in f.file_name for m in _LIBRARY_MARKERS):
                user = f
                break
    except Exception:  # any failure here only loses a location
        return call_site
    if (user is None and call_site) or first is None:
        return call_site
    frame = user or first
    return f"{_display_path(frame.file_name)}:{frame.start_line} ({frame.function_name})"


@functools.lru_cache(maxsize=1024)
def _display_path(path: str) -> str:
    """Relative to the working directory when below it, else absolute."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def _clean_scope(stack: str) -> tuple[list[str], str]:
    """Split a name stack into scope components without transform wrappers, and the phase it implies."""
    parts, phase = _clean_scope_cached(stack)
    return list(parts), phase


@functools.lru_cache(maxsize=65536)
def _clean_scope_cached(stack: str) -> tuple[tuple[str, ...], str]:  # a block's stacks recur in every pass
    phase = _roles.phase_of(stack)
    prev = None
    while prev != stack:
        prev, stack = stack, _WRAPPER.sub(r"\1", stack)
    return tuple(p for p in stack.split("/") if p), phase


def dtype_info(aval: Any) -> tuple[tuple[int, ...], str, int]:
    shape = tuple(int(d) for d in getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", None)
    if dtype is None:  # tokens and other non-array values
        return shape, type(aval).__name__, 0
    try:
        itemsize = int(dtype.itemsize)
    except (AttributeError, TypeError):
        itemsize = 8  # extended dtypes such as PRNG keys (two uint32 words for threefry)
    return shape, _dtype_name(dtype), math.prod(shape) * itemsize


@functools.lru_cache(maxsize=256)
def _dtype_name(dtype: Any) -> str:  # numpy's str(dtype) is slow, and a step has a handful of dtypes
    return str(dtype)


def _literal_text(val: Any) -> str:
    """A literal's value for its tensor's name: a scalar's repr, else its shape (jax's repr of a literal
    prints it through numpy's array printer, a third of tracing a large step's time)."""
    if isinstance(val, bool | int | float | complex):
        return repr(val)
    try:
        arr = np.asarray(val)
    except Exception:  # any failure here only loses a name
        return type(val).__name__
    return repr(arr.item()) if arr.size == 1 else f"array{list(arr.shape)}"


def params_digest(params: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    out = []
    for k, v in params.items():
        if isinstance(v, ClosedJaxpr | Jaxpr) or callable(v):
            continue
        if isinstance(v, tuple) and v and isinstance(v[0], ClosedJaxpr | Jaxpr):
            continue
        if isinstance(v, np.ndarray):  # printing arrays is slow and says little
            out.append((k, f"ndarray{list(v.shape)}:{v.dtype}"))
            continue
        s = str(v)
        out.append((k, s if len(s) <= 80 else s[:77] + "..."))
    return tuple(out)


class _Ctx:
    """What a nested walk inherits from its call site."""

    __slots__ = ("phase", "scope", "source")

    def __init__(self, scope: Sequence[str] = (), phase: str = "other", source: str = "") -> None:
        self.scope = list(scope)
        self.phase = phase
        self.source = source


class _Builder:
    """Accumulates tensors and ops for one Graph (a top-level step or one nested body)."""

    def __init__(self) -> None:
        self.t_name: list[str] = []
        self.t_shape: list[tuple[int, ...]] = []
        self.t_dtype: list[str] = []
        self.t_nbytes: list[int] = []
        self.t_role: list[Role] = []
        self.t_producer: list[int | None] = []
        self.ops: list[dict[str, Any]] = []
        self.values: dict[int, Any] = {}  # constant tensors' values (literals, consts of closed jaxprs)

    # ---- tensors ---------------------------------------------------------------------------------------

    def tensor(self, aval: Any, role: Role, name: str, producer: int | None) -> int:
        shape, dtype, nbytes = dtype_info(aval)
        tid = len(self.t_name)
        self.t_name.append(name or f"t{tid}")
        self.t_shape.append(shape)
        self.t_dtype.append(dtype)
        self.t_nbytes.append(nbytes)
        self.t_role.append(role)
        self.t_producer.append(producer)
        return tid

    def read(self, env: dict[Any, int], v: Any) -> int:
        if isinstance(v, Literal):
            tid = self.tensor(v.aval, Role.CONST, f"literal {_literal_text(v.val)}"[:40], None)
            self.values[tid] = v.val
            return tid
        return env[v]

    def bind_consts(self, closed: ClosedJaxpr, env: dict[Any, int]) -> None:
        for cv, c in zip(closed.jaxpr.constvars, closed.consts, strict=True):
            env[cv] = self.tensor(cv.aval, Role.CONST, f"const {np.shape(c)}", None)
            self.values[env[cv]] = c

    # ---- walking -----------------------------------------------------------------------------------------

    def walk(self, jaxpr: Jaxpr, env: dict[Any, int], ctx: _Ctx) -> None:
        for eqn in jaxpr.eqns:
            ins = [self.read(env, v) for v in eqn.invars]
            parts, phase = _clean_scope(str(eqn.source_info.name_stack))
            scope = ctx.scope + parts
            if phase == "other":
                phase = ctx.phase
            source = _source(eqn, ctx.source)
            sub = jc.inline_body(eqn)
            if sub is not None:
                sub_env: dict[Any, int] = {}
                self.bind_consts(sub, sub_env)
                for v, t in zip(sub.jaxpr.invars, ins, strict=True):
                    sub_env[v] = t
                self.walk(sub.jaxpr, sub_env, _Ctx(scope, phase, source))
                for v, ov in zip(eqn.outvars, sub.jaxpr.outvars, strict=True):
                    env[v] = self.read(sub_env, ov)
                continue
            self.add_op(eqn, ins, env, _Ctx(scope, phase, source))

    def add_op(self, eqn: Any, ins: list[int], env: dict[Any, int], ctx: _Ctx) -> None:
        name = eqn.primitive.name
        op_id = len(self.ops)
        scope, phase, source = ctx.scope, ctx.phase, ctx.source
        bodies, trip, flops = self.bodies_of(eqn, ins, ctx)
        if flops is None:
            flops = op_flops(
                name,
                [self.t_shape[i] for i in ins],
                [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars],
                eqn.params,
            )
        if flops is None:
            flops = 0.0
            unruled.warn_once(
                name,
                "no cost rule for primitive %r (first seen at %s); it counts 0 flops, and unless a "
                "sharding rule exists its operands and results are replicated",
                name,
                source or "an unknown location",
            )
        outs = []
        for v in eqn.outvars:
            tid = self.tensor(v.aval, Role.ACTIVATION, "", op_id)
            outs.append(tid)
            if not _is_dropvar(v):
                env[v] = tid
        self.ops.append(
            dict(
                primitive=name,
                inputs=tuple(ins),
                outputs=tuple(outs),
                flops=float(flops),
                bytes_in=sum(self.t_nbytes[i] for i in ins),
                bytes_out=sum(self.t_nbytes[i] for i in outs),
                source=source,
                scope="/".join(scope),
                layer=None,  # set by trace.structure once the step is whole
                phase=phase,
                params=params_digest(eqn.params),
                bodies=bodies,
                trip_count=trip,
                eqn=eqn,
            )
        )

    def bodies_of(
        self, eqn: Any, ins: list[int], ctx: _Ctx
    ) -> tuple[tuple[Graph, ...], int | None, float | None]:
        """Nested bodies of a control-flow op, its trip count and its flops (None: use the flop rule)."""
        name = eqn.primitive.name

        def sub(j: ClosedJaxpr, operands: Sequence[int]) -> Graph:
            return self.subgraph(j, operands, ctx)

        if name == "scan":
            layout = jc.scan_layout(eqn)
            body = sub(jc.scan_body(eqn), ins)
            return (body,), layout.length, layout.length * body.total_flops
        if name == "while":
            w = jc.while_layout(eqn)
            nc, nb = w.cond_nconsts, w.body_nconsts
            carry = ins[w.carry_from :]
            cond_j, body_j = jc.while_bodies(eqn)
            cond = sub(cond_j, ins[:nc] + carry)
            body = sub(body_j, ins[nc : nc + nb] + carry)
            trip = jc.while_trip_count(eqn)
            return (cond, body), trip, (trip or 1) * (body.total_flops + cond.total_flops)
        if name == "cond":
            branches = tuple(sub(b, ins[1:]) for b in jc.cond_branches(eqn))
            return branches, None, max(b.total_flops for b in branches)
        if name in jc.REMAT:
            body = sub(jc.remat_body(eqn), ins)
            return (body,), None, body.total_flops
        bodies = [self.subgraph(j, ins, ctx) for j in jc.sub_jaxprs(eqn.params) if len(j.jaxpr.invars) == len(ins)]
        if bodies:
            return tuple(bodies), None, sum(b.total_flops for b in bodies)
        return (), None, None

    def subgraph(self, closed: ClosedJaxpr, operands: Sequence[int], ctx: _Ctx) -> Graph:
        b = _Builder()
        env: dict[Any, int] = {}
        b.bind_consts(closed, env)
        inputs = []
        for k, (v, outer) in enumerate(zip(closed.jaxpr.invars, operands, strict=True)):
            role = self.t_role[outer] if self.t_role[outer] in _INHERITED_ROLES else Role.ACTIVATION
            tid = b.tensor(v.aval, role, f"{self.t_name[outer]}" if role is not Role.ACTIVATION else f"in{k}", None)
            env[v] = tid
            inputs.append(tid)
        b.walk(closed.jaxpr, env, ctx)
        outputs = [b.read(env, v) for v in closed.jaxpr.outvars]
        return b.finish(inputs, outputs, [f"out[{k}]" for k in range(len(outputs))], {}, closed)

    # ---- finishing -------------------------------------------------------------------------------------

    def finish(
        self,
        inputs: Sequence[int],
        outputs: Sequence[int],
        output_names: Sequence[str],
        aliases: Mapping[int, int],
        closed: ClosedJaxpr,
        in_tree: Any = None,
        out_tree: Any = None,
    ) -> Graph:
        consumers, live = links([op["inputs"] for op in self.ops], self.t_producer, outputs)
        out_set = set(outputs)
        tensors = []
        for tid in range(len(self.t_name)):
            prod = self.t_producer[tid]
            role = self.t_role[tid]
            if tid in out_set and role is Role.ACTIVATION and in_tree is not None:
                role = Role.OUTPUT
            tensors.append(
                Tensor(
                    id=tid,
                    name=self.t_name[tid],
                    shape=self.t_shape[tid],
                    dtype=self.t_dtype[tid],
                    nbytes=self.t_nbytes[tid],
                    role=role,
                    producer=prod,
                    consumers=consumers[tid],
                    live=live[tid],
                )
            )
        for name, tid in zip(output_names, outputs, strict=True):
            t = tensors[tid]
            if t.producer is not None and t.role is Role.OUTPUT:
                tensors[tid] = Tensor(**{s: getattr(t, s) for s in Tensor.__slots__} | {"name": name})
        ops = tuple(Op(id=i, **op) for i, op in enumerate(self.ops))
        return Graph(
            ops=ops,
            tensors=tuple(tensors),
            inputs=tuple(inputs),
            outputs=tuple(outputs),
            output_names=tuple(output_names),
            output_aliases=dict(aliases),
            jaxpr=closed,
            in_tree=in_tree,
            out_tree=out_tree,
            constants=dict(self.values),
        )


def _is_dropvar(v: Any) -> bool:
    return type(v).__name__ == "DropVar"


_OK_LEAVES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, bool, int, float, complex)


def _describe_args(names: Sequence[str], leaves: Sequence[Any], limit: int = 8) -> str:
    lines = []
    for n, x in list(zip(names, leaves, strict=True))[:limit]:
        shape = getattr(x, "shape", None)
        dtype = getattr(x, "dtype", None)
        lines.append(f"  {n}: {dtype}{list(shape) if shape is not None else ''}")
    if len(leaves) > limit:
        lines.append(f"  ... and {len(leaves) - limit} more")
    return "\n".join(lines)


def trace(
    fn: Callable[..., Any],
    *args: Any,
    roles: Mapping[str | int, Role | str] | None = None,
    batch_argnums: Sequence[int] | int | None = None,
) -> Graph:
    """Trace ``fn(*args)`` into a Graph without running it.

    ``args`` may hold real arrays or ``jax.ShapeDtypeStruct`` leaves (nothing is allocated either way), so a
    39B-parameter step can be traced on a laptop. Roles of the argument leaves are read from what the step
    does with them (see ``autoshard.trace.roles``); ``roles`` overrides them by path prefix
    (``{"state.ema": "param"}``) or argument position (``{2: "batch"}``), and ``batch_argnums`` marks whole
    arguments as the batch.
    """
    t = _Traced.of(fn, args, _roles.with_batch_argnums(roles, batch_argnums))
    return graph_of_jaxpr(t.closed, t.in_names, t.roles, t.out_names, t.aliases, t.in_tree, t.out_tree)


def input_roles(fn: Callable[..., Any], *args: Any, roles: Mapping[str | int, Role | str] | None = None,
                batch_argnums: Sequence[int] | int | None = None) -> list[Role]:
    """The role of each flattened argument leaf, as ``trace`` would give it, without building the Graph
    (``autoshard.distributed`` reads which leaves are a process's rows of the batch before the step is
    traced at its global size)."""
    return _Traced.of(fn, args, _roles.with_batch_argnums(roles, batch_argnums)).roles


@dataclasses.dataclass(frozen=True, slots=True)
class _Traced:
    """A step's jaxpr with its inputs and outputs named and its inputs' roles read."""

    closed: ClosedJaxpr
    in_names: list[str]
    roles: list[Role]
    out_names: list[str]
    aliases: dict[int, int]
    in_tree: Any
    out_tree: Any

    @staticmethod
    def of(fn: Callable[..., Any], args: tuple[Any, ...], roles: Mapping[str | int, Role | str] | None) -> _Traced:
        fname = getattr(fn, "__name__", type(fn).__name__)
        if not callable(fn):
            raise TraceError(f"autoshard.trace expects a function to trace, got {type(fn).__name__}: {fn!r}")
        names_of_args = _roles.arg_names(fn, len(args))
        try:
            inspect.signature(fn).bind(*args)
        except TypeError as e:
            raise TraceError(
                f"{fname} cannot take the {len(args)} example argument(s) given ({e}); "
                f"pass one example per parameter of {fname}, e.g. trace({fname}, state, batch)"
            ) from None
        except ValueError:  # no signature available (builtins, some callables): let tracing decide
            pass
        flat, in_tree = jax.tree_util.tree_flatten_with_path(args)
        in_paths = [(path[0].idx, tuple(path[1:])) for path, _ in flat]
        in_names = [_roles.leaf_name(names_of_args[a], p) for a, p in in_paths]
        leaves = [x for _, x in flat]
        for n, x in zip(in_names, leaves, strict=True):
            if not isinstance(x, _OK_LEAVES):
                raise TraceError(
                    f"example argument {n} is a {type(x).__name__}; example arguments must hold arrays, "
                    "jax.ShapeDtypeStruct or Python numbers (build abstract ones with jax.eval_shape), or mark "
                    "non-array fields static in the pytree"
                )
        try:
            closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError,
                jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError) as e:
            raise TraceError(
                f"{fname} is not traceable by JAX: it turns a traced value into a concrete NumPy or Python value "
                f"({type(e).__name__}). Use jax.numpy instead of numpy inside the step, jax.lax.cond/while_loop "
                f"instead of Python branching on array values. JAX's message:\n{str(e).splitlines()[0]}"
            ) from e
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TraceError(
                f"tracing {fname} with the example arguments failed: {type(e).__name__}: {first}\n"
                f"The example arguments were:\n{_describe_args(in_names, leaves)}\n"
                f"Check that their pytree structure, shapes and dtypes are what {fname} expects."
            ) from e

        out_flat, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
        out_paths = [tuple(p) for p, _ in out_flat]
        single = not isinstance(out_shape, tuple | list)
        out_names = [_roles.leaf_name("out", p) for p in out_paths]
        aliases = _roles.output_aliases(in_paths, out_paths, closed.in_avals, closed.out_avals, single,
                                        args, out_shape)
        role_list = _roles.infer_roles(in_paths, names_of_args, closed.in_avals, _roles.dataflow(closed), aliases)
        if roles:
            _roles.apply_overrides(in_names, role_list, roles, [a for a, _ in in_paths])

        return _Traced(closed, in_names, role_list, out_names, aliases, in_tree, out_tree)


def graph_of_jaxpr(closed: ClosedJaxpr, in_names: Sequence[str], roles: Sequence[Role], out_names: Sequence[str],
                   aliases: Mapping[int, int], in_tree: Any = None, out_tree: Any = None) -> Graph:
    """The Graph of a closed jaxpr whose inputs and outputs are already named (``trace`` names them from
    the function's pytrees; ``trace.remat`` keeps a traced step's names for its rewritten jaxpr)."""
    b = _Builder()
    env: dict[Any, int] = {}
    b.bind_consts(closed, env)
    inputs = []
    for v, n, r in zip(closed.jaxpr.invars, in_names, roles, strict=True):
        env[v] = b.tensor(v.aval, r, n, None)
        inputs.append(env[v])
    b.walk(closed.jaxpr, env, _Ctx())
    outputs = [b.read(env, v) for v in closed.jaxpr.outvars]
    return tag_blocks(b.finish(inputs, outputs, out_names, aliases, closed, in_tree, out_tree))

"""Evaluate a traced Graph op by op on JAX values, pinning the spec map's choices as it goes.

``Interpreter.run(graph, key, args)`` is the inverse of tracing: every op binds its jaxpr equation's
primitive again (``eqn.primitive.bind(*inputs, **params)``), and every value whose tensor has a spec in scope
``key`` is passed through ``jax.lax.with_sharding_constraint`` (on a mesh of one device, where every layout is
the whole array, none is placed). Run under ``jax.jit`` it re-emits the step
with the constraints in place; Shardy then inserts the collectives.

Where values come from
----------------------
- graph inputs: the arguments, in ``graph.inputs`` order (1:1 with the jaxpr's invars);
- op outputs: the bound results, in ``op.outputs`` order (1:1 with ``eqn.outvars``);
- constants (``Role.CONST``, no producer): the tracer made one tensor per literal occurrence and one per
  constvar, and kept their values in ``graph.constants`` (keyed by tensor: jax 0.11 shares one jaxpr
  between call sites, so a variable of an inlined call can stand for a different value at each site).

FSDP's second gather
--------------------
A backward op reading a split input of its scope (a ZeRO-3 weight) reads it through an optimization barrier
tied to the op's other operands (``_regather``): XLA then gathers the weight again for the backward matmul,
as the plan priced it, instead of reusing the forward's gathered copy (CSE) and holding it across the step.

Control flow
------------
``with_sharding_constraint`` reaches only the level it is called at, so scan, while, cond and remat bodies
are rebuilt: the body Graph is evaluated by this same interpreter (with its own scope's specs) under
``jax.make_jaxpr`` on the body's input avals, and the primitive is bound with the new jaxpr. Values the new
body closes over (constants of the body) become extra leading operands: a scan's constants, a while's
condition and body constants and a remat's operands grow (``autoshard.trace.jaxpr_compat`` writes the
params of each jax release); a cond's branches all take every branch's
constants so that their signatures agree. Other ops with bodies (``custom_linear_solve``, ...) are bound
unchanged: no constraint reaches inside them, and this is logged once per primitive. A ``shard_map`` region is
bound as the user wrote it, moved onto the device mesh, without a warning: its layouts are fixed by its specs,
and the planner planned around them (``strategies.custom``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxpr_as_fun

from autoshard.emit.draws import DRAW, offset_bits
from autoshard.emit.specs import EmitError, named_sharding, normalize_key
from autoshard.trace import jaxpr_compat as jc
from autoshard.trace.graph import Graph, Op, Scope
from cost_models.spec import ShardingSpec

log = logging.getLogger("autoshard")

try:  # private, stable for years; used to turn a rebuilt body's constvars into leading invars
    from jax._src.interpreters.partial_eval import convert_constvars_jaxpr as _convert_constvars
except ImportError:  # pragma: no cover
    _convert_constvars = None

class Interpreter:
    """Re-binds a Graph's ops with the spec map's constraints; one instance per emitted program."""

    def __init__(self, mesh: jax.sharding.Mesh, specs: Mapping[Scope, Mapping[int, ShardingSpec]]) -> None:
        self.mesh = mesh
        # on one device every layout is the whole array: constraints would pin nothing, so none are placed
        self.specs = {normalize_key(k): dict(v) for k, v in specs.items()} if mesh.size > 1 else {}
        self._shardings: dict[ShardingSpec, jax.sharding.NamedSharding] = {}
        self._warned: set[str] = set()
        self.constraints: dict[Scope, int] = {}  # constraints placed per scope, in the last trace
        self.rebuilt: dict[Scope, str] = {}  # scopes whose body was rebuilt, and the op's primitive
        self.hoisted: dict[Scope, int] = {}  # constants a rebuilt body closed over, made operands
        # draws over the batch's rows (by scope and op id) computed as block ``block`` of a larger draw
        # (``emit.draws.offset_bits``): a pipeline's microbatch drawing jax.jit's numbers (``pipeline.draws``)
        self.draws: frozenset[tuple[Scope, int]] = frozenset()
        self.block: Any = None

    def reset(self) -> None:
        """Forget what the previous trace recorded (``constraints``, ``rebuilt``, ``hoisted``)."""
        self.constraints, self.rebuilt, self.hoisted = {}, {}, {}

    # ---- values --------------------------------------------------------------------------------------

    def sharding(self, spec: ShardingSpec) -> jax.sharding.NamedSharding:
        s = self._shardings.get(spec)
        if s is None:
            s = self._shardings[spec] = named_sharding(self.mesh, spec)
        return s

    def _pin(self, x: Any, tid: int, scope: Mapping[int, ShardingSpec], key: Scope) -> Any:
        spec = scope.get(tid)
        if spec is None:
            return x
        self.constraints[key] = self.constraints.get(key, 0) + 1
        return jax.lax.with_sharding_constraint(x, self.sharding(spec))

    def pin(self, x: Any, tid: int, key: Scope = ()) -> Any:
        """``x`` constrained to the plan's layout of tensor ``tid`` in scope ``key`` (as is, if it has none)."""
        return self._pin(x, tid, self.specs.get(key, {}), key)

    @staticmethod
    def _split_inputs(graph: Graph, scope: Mapping[int, ShardingSpec]) -> frozenset[int]:
        """The inputs of ``graph`` pinned to a layout that splits them (``_regather``'s candidates)."""
        return frozenset(t for t in graph.inputs if (s := scope.get(t)) is not None and not s.is_replicated())

    # ---- evaluation ----------------------------------------------------------------------------------

    def run(self, graph: Graph, key: Scope, args: Sequence[Any], *, pin_inputs: bool = True) -> list[Any]:
        """Evaluate ``graph`` (the scope ``key``) on ``args``; returns its outputs in ``graph.outputs`` order.

        ``pin_inputs=False`` skips constraining the inputs (the top level, where ``in_shardings`` do it).
        """
        if len(args) != len(graph.inputs):
            raise EmitError(f"the graph of scope {key!r} takes {len(graph.inputs)} inputs, got {len(args)}")
        scope = self.specs.get(key, {})
        known = graph.constants
        env: dict[int, Any] = {}
        for tid, x in zip(graph.inputs, args, strict=True):
            env[tid] = self._pin(x, tid, scope, key) if pin_inputs else x

        def read(tid: int, atom: Any, reader: Op | int) -> Any:
            if tid in env:
                return env[tid]
            if isinstance(atom, Literal):
                val = atom.val
            elif tid in known:
                val = known[tid]
            else:
                t = graph.tensors[tid]
                what = reader.where() if isinstance(reader, Op) else f"output {reader} of scope {key!r}"
                raise EmitError(
                    f"no value for tensor {tid} {t.name!r} {t.dtype}{list(t.shape)}, read by {what}: it is "
                    "neither produced by an op, a graph input, a literal nor a known constant; the Graph "
                    "may not come from autoshard.trace or may have been edited (run graph.verify())"
                )
            env[tid] = val = self._pin(val, tid, scope, key)
            return val

        self._eval(graph.ops, key, env, read, regather=self._split_inputs(graph, scope))
        outvars = graph.jaxpr.jaxpr.outvars
        return [read(t, a, i) for i, (t, a) in enumerate(zip(graph.outputs, outvars, strict=True))]

    def run_ops(self, graph: Graph, ops: Sequence[Op], inputs: Sequence[int], args: Sequence[Any],
                outputs: Sequence[int]) -> list[Any]:
        """Evaluate some top-level ops of ``graph`` (a pipeline stage's program): ``inputs`` are the tensor
        ids ``args`` stand for (already laid out by the caller); returns the tensors ``outputs``."""
        scope = self.specs.get((), {})
        known = graph.constants
        env: dict[int, Any] = dict(zip(inputs, args, strict=True))

        def read(tid: int, atom: Any, reader: Op) -> Any:
            if tid in env:
                return env[tid]
            if isinstance(atom, Literal):
                return atom.val
            if tid in known:
                env[tid] = val = self._pin(known[tid], tid, scope, ())
                return val
            t = graph.tensors[tid]
            raise EmitError(f"no value for tensor {tid} {t.name!r}, read by {reader.where()}: the program's "
                            "inputs do not include it (a pipeline partition that lost a dependency)")

        self._eval(ops, (), env, read)
        return [env[t] for t in outputs]

    def _eval(self, ops: Sequence[Op], key: Scope, env: dict[int, Any], read: Callable[..., Any], *,
              regather: frozenset[int] = frozenset()) -> None:
        scope = self.specs.get(key, {})
        for op in ops:
            invals = [read(t, a, op) for t, a in zip(op.inputs, op.eqn.invars, strict=True)]
            if regather and op.phase == "backward":
                invals = _regather(op, invals, regather)
            outs = self._bind(op, key, invals)
            if len(outs) != len(op.outputs):
                raise EmitError(f"{op.where()} returned {len(outs)} results, the graph expects {len(op.outputs)}")
            for tid, x in zip(op.outputs, outs, strict=True):
                env[tid] = self._pin(x, tid, scope, key)

    def _bind(self, op: Op, key: Scope, invals: list[Any]) -> list[Any]:
        eqn = op.eqn
        name = eqn.primitive.name
        rule = _REBUILD.get(name)
        if rule is None and name in jc.REMAT:
            rule = Interpreter._remat
        with jc.eqn_context(eqn):
            if name == DRAW and (key, op.id) in self.draws:
                if self.block is None:
                    raise EmitError(f"{op.where()} draws over the batch's rows, but this program was given no "
                                    "microbatch index to offset it by")
                return [offset_bits(invals[0], int(eqn.params["bit_width"]), tuple(eqn.params["shape"]),
                                    self.block)]
            if op.bodies and rule is not None and _convert_constvars is not None:
                outs = rule(self, op, key, invals)
            else:
                if op.bodies and name not in self._warned and name not in _OPAQUE:
                    self._warned.add(name)
                    log.warning(
                        "autoshard.emit: %s has nested jaxprs that emission does not rebuild; it is bound "
                        "as traced and no sharding constraint reaches inside it", op.where())
                subfuns, params = jc.bind_params(eqn)
                if name == "shard_map":
                    params = jc.region_on_mesh(params, self.mesh)
                outs = eqn.primitive.bind(*subfuns, *invals, **params)
        return list(outs) if eqn.primitive.multiple_results else [outs]

    # ---- rebuilding bodies ---------------------------------------------------------------------------

    def rebuild(self, body: Graph, key: Scope, name: str) -> tuple[Jaxpr, list[Any]]:
        """Trace ``body`` with its scope's constraints into an open jaxpr whose leading invars are the
        constants it closes over; returns ``(jaxpr, constants)``."""
        self.rebuilt[key] = name

        def fn(*xs: Any) -> list[Any]:
            return self.run(body, key, xs)

        closed = jax.make_jaxpr(fn)(*body.jaxpr.in_avals)
        self.hoisted[key] = len(closed.consts)
        if not closed.consts:
            return closed.jaxpr, []
        return _convert_constvars(closed.jaxpr), list(closed.consts)

    def _scan(self, op: Op, key: Scope, invals: list[Any]) -> Any:
        jaxpr, consts = self.rebuild(op.bodies[0], (*key, (op.id, 0)), "scan")
        return op.eqn.primitive.bind(*consts, *invals, **jc.scan_params(op.eqn, jaxpr, len(consts)))

    def _while(self, op: Op, key: Scope, invals: list[Any]) -> Any:
        w = jc.while_layout(op.eqn)
        nc, nb = w.cond_nconsts, w.body_nconsts
        cj, cc = self.rebuild(op.bodies[0], (*key, (op.id, 0)), "while cond")
        bj, bc = self.rebuild(op.bodies[1], (*key, (op.id, 1)), "while body")
        p = jc.while_params(op.eqn, cj, bj, len(cc), len(bc))
        operands = [*cc, *invals[:nc], *bc, *invals[nc : nc + nb], *invals[nc + nb :]]
        return op.eqn.primitive.bind(*operands, **p)

    def _cond(self, op: Op, key: Scope, invals: list[Any]) -> Any:
        built = [self.rebuild(b, (*key, (op.id, i)), "cond branch") for i, b in enumerate(op.bodies)]
        all_consts = [c for _, cs in built for c in cs]
        if not all_consts:
            branches = [ClosedJaxpr(j, ()) for j, _ in built]
        else:  # every branch takes every branch's constants, so that the signatures agree
            avals = [jax.typeof(c) for c in all_consts] + list(op.bodies[0].jaxpr.in_avals)
            branches, off = [], 0
            for j, cs in built:
                branches.append(jax.make_jaxpr(_select_args(j, off, len(cs), len(all_consts)))(*avals))
                off += len(cs)
        p = jc.cond_params(op.eqn, branches)
        return op.eqn.primitive.bind(invals[0], *all_consts, *invals[1:], **p)

    def _remat(self, op: Op, key: Scope, invals: list[Any]) -> Any:
        jaxpr, consts = self.rebuild(op.bodies[0], (*key, (op.id, 0)), op.eqn.primitive.name)
        return op.eqn.primitive.bind(*consts, *invals, **jc.remat_params(op.eqn, jaxpr))


def _regather(op: Op, invals: list[Any], split: frozenset[int]) -> list[Any]:
    """A backward op's split inputs read through an optimization barrier tied to its other operands.

    The planner prices every reader's resharding of a tensor on its own edge and holds a gathered copy only
    while its reader runs (``planner.build``): a ZeRO-3 weight is gathered for the forward matmul and again
    for the backward one, as FSDP does. Left alone, XLA's CSE merges the two gathers and keeps the whole
    weight alive from the forward pass to the backward one, which is neither the collectives nor the memory
    the plan priced. The barrier makes the backward read a different value, available only once the op's
    backward operands are, so the gather runs again where the backward op needs it."""
    mine = [i for i, t in enumerate(op.inputs) if t in split]
    ties = [i for i, (t, a) in enumerate(zip(op.inputs, op.eqn.invars, strict=True))
            if t not in split and not isinstance(a, Literal)]
    if not mine or not ties:
        return invals
    tied = jax.lax.optimization_barrier(tuple(invals[i] for i in mine + ties))
    out = list(invals)
    for i, x in zip(mine + ties, tied, strict=True):
        out[i] = x
    return out


def _select_args(jaxpr: Jaxpr, off: int, n: int, total: int) -> Callable[..., list[Any]]:
    """A function of (all constants, operands) that runs ``jaxpr`` on its own constants and the operands."""
    fn = jaxpr_as_fun(ClosedJaxpr(jaxpr, ()))

    def call(*args: Any) -> list[Any]:
        return fn(*args[off : off + n], *args[total:])

    return call


_OPAQUE = frozenset({"shard_map", "custom_partitioning"})
"""Ops with bodies bound as traced by design: a ``shard_map`` region runs as written (on the device mesh:
``jaxpr_compat.region_on_mesh``), and a ``custom_partitioning`` body is only the call's single-device meaning
(its partition callback says how it runs split)."""

_REBUILD: dict[str, Callable[[Interpreter, Op, Scope, list[Any]], Any]] = {
    "scan": Interpreter._scan,
    "while": Interpreter._while,
    "cond": Interpreter._cond,
}

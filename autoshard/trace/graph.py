"""The computation graph autoshard plans over: ops and tensors, built from a jaxpr.

A ``Graph`` is pure data apart from one thing: each ``Op`` keeps the jaxpr equation it came from (``Op.eqn``)
so that emission can bind it again. Everything the later passes need (shapes, dtypes, roles, flops, bytes,
producer/consumer links, live intervals, nested bodies of scan/while/cond/remat) is in plain fields.

Conventions
-----------
- Op ids are positions in ``Graph.ops``, which is a topological schedule (the jaxpr's own order).
- Tensor ids are positions in ``Graph.tensors``. A tensor is produced by one op (``producer``), or is a graph
  input or a constant (``producer is None``).
- Time step ``t`` is the op index. A tensor is live over ``[start, end)``: from its producer (0 for inputs and
  constants) up to one past its last consumer; graph outputs live to ``len(ops)``.
- Nested bodies are Graphs of their own with their own ids and schedule. For a scan, ``trip_count`` is the
  number of iterations and the op's flops are ``trip_count`` times the body's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import networkx as nx

from autoshard.errors import GraphError
from autoshard.trace.roles import Role


@functools.cache
def inexact_dtype(name: str) -> bool:
    """``Tensor.inexact`` for a dtype's name: jax's ``issubdtype``, which knows the ml_dtypes floats, and False
    for a name numpy cannot read (a PRNG key's ``key<impl>``)."""
    import jax.numpy as jnp

    try:
        return bool(jnp.issubdtype(name, jnp.inexact))
    except TypeError:
        return False


# Where a tensor lives: the path of (op id, body index) from the top-level graph into nested bodies;
# () is the step itself. Tensor ids are per graph, so a tensor is named by (scope, id).
Scope = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Tensor:
    id: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    role: Role
    producer: int | None
    consumers: tuple[int, ...]
    live: tuple[int, int]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def inexact(self) -> bool:
        """Whether its dtype is a floating or complex one (what a gradient or a partial sum can be): bfloat16
        and the float8 types included, which numpy's own ``issubdtype`` does not count; False for integers,
        booleans and PRNG keys (``key<fry>``: a dropout key passed to the step)."""
        return inexact_dtype(self.dtype)

    def __repr__(self) -> str:
        dims = ",".join(map(str, self.shape))
        return f"Tensor({self.id} {self.name!r} {self.dtype}[{dims}] {self.role.value})"


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Op:
    id: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    flops: float
    bytes_in: int
    bytes_out: int
    source: str  # "file.py:line (function)" of the user code that made it, or ""
    scope: str  # the name stack without transform wrappers, e.g. "GPT/block_3/attn"
    layer: str | None  # its repeated block's tag (``trace.structure``), e.g. "GPT/block_3"; None outside blocks
    phase: str  # "forward", "backward" or "other" (optimizer update, code outside grad)
    params: tuple[tuple[str, str], ...]  # short printable digest of the equation's non-jaxpr params
    bodies: tuple[Graph, ...] = ()  # scan/remat: (body,); while: (cond, body); cond: branches
    trip_count: int | None = None  # scan length; while loops with a recognisable counter; else None
    eqn: Any = dataclasses.field(default=None, repr=False)  # the jaxpr equation, for emission

    def param(self, key: str) -> str | None:
        for k, v in self.params:
            if k == key:
                return v
        return None

    def where(self) -> str:
        """How error messages and summaries name this op."""
        loc = f" at {self.source}" if self.source else ""
        scope = f" in {self.scope}" if self.scope else ""
        return f"{self.primitive} (op {self.id}){scope}{loc}"

    def __repr__(self) -> str:
        return f"Op({self.id} {self.primitive} in={list(self.inputs)} out={list(self.outputs)})"


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Graph:
    ops: tuple[Op, ...]
    tensors: tuple[Tensor, ...]
    inputs: tuple[int, ...]  # tensor ids, in the flattened order of the traced function's arguments
    outputs: tuple[int, ...]  # tensor ids, in the flattened order of its results
    output_names: tuple[str, ...]
    # output position -> input position where the result is the new value of that input (train state)
    output_aliases: Mapping[int, int] = dataclasses.field(default_factory=dict)
    # the ClosedJaxpr it was built from (a recompute rewrite keeps the traced step's: the same signature)
    jaxpr: Any = dataclasses.field(default=None, repr=False)
    in_tree: Any = dataclasses.field(default=None, repr=False)
    out_tree: Any = dataclasses.field(default=None, repr=False)
    # tensor id -> value, for the constants (literals, closed-over arrays) that emission binds again. Keyed
    # by tensor, not by jaxpr variable: jax 0.11 shares one jaxpr between call sites (optax's two
    # tree_bias_correction calls), so one inner variable can stand for several values.
    constants: Mapping[int, Any] = dataclasses.field(default_factory=dict, repr=False)
    # per-instance tables of values later passes derive purely from this graph (see ``memo``); a copy made
    # with ``dataclasses.replace`` starts with its own, empty
    _memo: dict[str, dict[Any, Any]] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                                         compare=False)

    def memo(self, name: str) -> dict[Any, Any]:
        """A table for values a pass derives purely from this graph (a pipeline's cut of some ops into a
        sub-graph, asked for again by every layer's pricing and every stage's plan): the graph is
        immutable, so they hold as long as it lives and never leak to another graph."""
        return self._memo.setdefault(name, {})

    # ---- queries -------------------------------------------------------------------------------------

    def constant_value(self, op: Op, i: int) -> Any | None:
        """The value of ``op``'s operand ``i`` when it is a constant (a literal, or a closed-over array: no
        producer and a known value), else None."""
        t = op.inputs[i]
        if self.tensors[t].producer is not None:
            return None
        atom = op.eqn.invars[i] if op.eqn is not None else None
        return getattr(atom, "val", self.constants.get(t))

    def tensor(self, name: str) -> Tensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"no tensor named {name!r}")

    def input_tensors(self, role: Role | None = None) -> list[Tensor]:
        ts = [self.tensors[i] for i in self.inputs]
        return [t for t in ts if role is None or t.role is role]

    @property
    def total_flops(self) -> float:
        return float(sum(op.flops for op in self.ops))

    def flops_by_phase(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for op in self.ops:
            out[op.phase] += op.flops
        return dict(out)

    def walk(self) -> list[tuple[int, Op]]:
        """Every op, nested bodies included, as (depth, op) in schedule order."""
        out: list[tuple[int, Op]] = []

        def go(g: Graph, depth: int) -> None:
            for op in g.ops:
                out.append((depth, op))
                for b in op.bodies:
                    go(b, depth + 1)

        go(self, 0)
        return out

    def role_bytes(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for t in self.input_tensors():
            out[t.role.value] += t.nbytes
        return dict(out)

    def peak_live_bytes(self) -> int:
        """Peak of the summed bytes of live tensors over the schedule, unsharded (inputs included)."""
        return peak_of_intervals(((t.live, t.nbytes) for t in self.tensors), len(self.ops))

    def stats(self) -> dict[str, Any]:
        nested_ops = sum(1 for d, _ in self.walk() if d > 0)
        nested_tensors = sum(len(b.tensors) for _, op in self.walk() for b in op.bodies)
        params = self.input_tensors(Role.PARAM)
        return {
            "ops": len(self.ops),
            "tensors": len(self.tensors),
            "nested_ops": nested_ops,
            "nested_tensors": nested_tensors,
            "flops": self.total_flops,
            "flops_by_phase": self.flops_by_phase(),
            "param_count": int(sum(t.size for t in params)),
            "bytes_by_role": self.role_bytes(),
            "peak_live_bytes_unsharded": self.peak_live_bytes(),
        }

    # ---- invariants ----------------------------------------------------------------------------------

    def verify(self) -> None:
        """Check the graph's invariants; raise GraphError naming the op or tensor that breaks one.

        Acyclic and topologically ordered (every input of op i is a graph input, a constant, or produced by
        an op before i); every tensor produced exactly once and its producer/consumer links agree with the
        ops; shapes consistent with the equations (outputs match the jaxpr's avals; op-specific shape
        rules for dot_general and elementwise ops); live intervals cover producer and consumers; nested
        bodies verify and their arity matches the op.
        """
        from autoshard.trace.shape_checks import check_op_shapes

        n_t = len(self.tensors)
        for i, t in enumerate(self.tensors):
            if t.id != i:
                raise GraphError(f"tensor at position {i} has id {t.id}")
        produced_by: dict[int, int] = {}
        consumers: dict[int, list[int]] = defaultdict(list)
        for i, op in enumerate(self.ops):
            if op.id != i:
                raise GraphError(f"op at position {i} has id {op.id}")
            for tid in op.inputs:
                if not 0 <= tid < n_t:
                    raise GraphError(f"{op.where()} reads unknown tensor {tid}")
                prod = self.tensors[tid].producer
                if prod is not None and prod >= i:
                    raise GraphError(
                        f"{op.where()} reads {self.tensors[tid]!r} produced later by op {prod}: not acyclic "
                        "or not in schedule order"
                    )
                if not consumers[tid] or consumers[tid][-1] != i:
                    consumers[tid].append(i)
            for tid in op.outputs:
                if tid in produced_by:
                    raise GraphError(
                        f"{self.tensors[tid]!r} is produced twice: by op {produced_by[tid]} and {op.where()}"
                    )
                produced_by[tid] = i
                if self.tensors[tid].producer != i:
                    raise GraphError(f"{self.tensors[tid]!r} names producer {self.tensors[tid].producer}, "
                                     f"but {op.where()} produces it")
            check_op_shapes(self, op)
            for b in op.bodies:
                b.verify()
        input_set = set(self.inputs)
        for t in self.tensors:
            if t.producer is None and t.role is not Role.CONST and t.id not in input_set:
                raise GraphError(f"{t!r} has no producer and is neither a graph input nor a constant")
            if t.producer is not None and produced_by.get(t.id) != t.producer:
                raise GraphError(f"{t!r} names producer {t.producer}, which does not list it as an output")
            if tuple(consumers.get(t.id, ())) != t.consumers:
                raise GraphError(f"{t!r} lists consumers {t.consumers}, the ops say {consumers.get(t.id, [])}")
            start, end = t.live
            first = 0 if t.producer is None else t.producer
            if start > first or (t.consumers and end <= t.consumers[-1]) or end < start:
                raise GraphError(f"{t!r} has live interval {t.live} not covering its producer and consumers")
            if t.nbytes < 0 or any(d < 0 for d in t.shape):
                raise GraphError(f"{t!r} has a negative size")
        for tid in self.outputs:
            if not 0 <= tid < n_t:
                raise GraphError(f"graph output refers to unknown tensor {tid}")
            if self.tensors[tid].live[1] < len(self.ops):
                raise GraphError(f"output {self.tensors[tid]!r} dies before the end of the schedule")
        if len(self.output_names) != len(self.outputs):
            raise GraphError("output_names and outputs differ in length")
        for o, i in self.output_aliases.items():
            to, ti = self.tensors[self.outputs[o]], self.tensors[self.inputs[i]]
            if to.shape != ti.shape or to.dtype != ti.dtype:
                raise GraphError(f"output {to!r} is aliased to input {ti!r} but differs in shape or dtype")

    # ---- views ---------------------------------------------------------------------------------------

    def to_networkx(self) -> nx.MultiDiGraph:
        """Ops as nodes (with their fields as attributes), one edge per tensor passed between two ops.

        Graph inputs and constants appear as nodes ``("input", tensor_id)`` so that every tensor has a source.
        """
        g = nx.MultiDiGraph()
        for op in self.ops:
            g.add_node(op.id, kind="op", primitive=op.primitive, flops=op.flops, scope=op.scope,
                       layer=op.layer, phase=op.phase, source=op.source)
        for t in self.tensors:
            src: Any = t.producer
            if src is None:
                if not t.consumers:
                    continue
                src = ("input", t.id)
                g.add_node(src, kind=t.role.value, name=t.name)
            for c in t.consumers:
                g.add_edge(src, c, key=t.id, tensor=t.id, bytes=t.nbytes, shape=t.shape, dtype=t.dtype)
        return g

    def summary(self, top: int = 10) -> str:
        """A readable table: ops by primitive, flops, bytes, parameters, largest tensors."""
        from autoshard.trace.summary import format_summary

        return format_summary(self, top=top)


def peak_of_intervals(spans: Iterable[tuple[tuple[int, int], int]], steps: int) -> int:
    """The largest sum of ``size`` over the half-open intervals ``[s, e)`` of ``spans`` live at one time step
    ``0 <= t <= steps``."""
    delta = [0] * (steps + 2)
    for (s, e), size in spans:
        if e > s:
            delta[s] += size
            delta[e] -= size
    peak = cur = 0
    for d in delta:
        cur += d
        peak = max(peak, cur)
    return peak


def links(op_inputs: Sequence[Sequence[int]], producers: Sequence[int | None], outputs: Collection[int],
          ) -> tuple[list[tuple[int, ...]], list[tuple[int, int]]]:
    """Per tensor (``producers[t]``: the op making it, None for inputs and constants): the ops reading it
    (``op_inputs[i]``: op ``i``'s inputs), each once in op order, and its live interval (module docstring:
    from its producer up to one past its last consumer, a step output to the end; an unread value made by
    an op lives one step, an unread input not at all)."""
    n_ops = len(op_inputs)
    consumers: list[list[int]] = [[] for _ in producers]
    for i, ins in enumerate(op_inputs):
        for t in ins:
            c = consumers[t]
            if not c or c[-1] != i:
                c.append(i)
    out_set = set(outputs)
    live = []
    for t, (prod, cons) in enumerate(zip(producers, consumers, strict=True)):
        start = 0 if prod is None else prod
        end = n_ops if t in out_set else cons[-1] + 1 if cons else start + 1 if prod is not None else start
        live.append((start, max(end, start)))
    return [tuple(c) for c in consumers], live

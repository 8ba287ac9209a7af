"""A layer stack written as one ``scan`` (``nn.scan``, ``jax.lax.scan`` over stacked weights), unrolled into
numbered blocks: what a pipeline needs to cut the layers into stages, and what the intra-operator planner
plans and emits by default (``PlanOptions.unroll_scans``).

A traced step keeps a scan over layers as one op (``tracer``). A pipeline places whole layers on stages, and
one op cannot be split. And a scan runs slower than its layers written out: every value its body keeps for
the backward pass is written into a stacked buffer (a body's output), where XLA fuses the unrolled step's
elementwise values into their readers across the forward and backward pass (on one H200, GPT-350M and
GPT-1.3B scanned ran 1.68x and 1.50x slower, and held 1.49x and 1.46x the memory:
``benchmarks/gpu_issue46_results.md``). This pass rewrites the traced step so that each iteration of such a
scan is a block of its own, as if the layers had been written unrolled (``block_0``, ``block_1``, ...), and
the rest of the machinery (the intra-operator planner and ``emit``; ``pipeline.partition``,
``pipeline.uniform``, the stage DP, both runtimes) reads it like any unrolled model. Unrolled, the step
compiles longer (one copy of the body per layer): ``unroll_scans=False`` keeps the scan.

Which scans: a top-level ``scan`` of at least 2 iterations that slices a parameter per iteration (its
``xs`` hold a parameter input: the stacked weights) or reads the per-iteration values of a scan already
unrolled (the backward pass's scan, reading the forward's residuals). A scan over time steps whose weights
are constants of the body is left alone.

How, for a scan of ``L`` iterations with constants ``c``, carry ``h`` and scanned inputs ``xs``:

- iteration ``j`` (``L − 1`` down to 0 for ``reverse``) binds the body's ops again on ``(c, h, xs[j])``
  under the scope ``<scan scope>/<stack>_j`` (``<stack>``: the scope the body's ops sit in, ``blocks`` for
  a flax ``nn.scan`` named so), so the tracer tags them as block ``j`` in the phase they had;
- ``xs[j]`` of a stacked input is a static slice of it (``index_in_dim``), made once per input and ``j``
  outside any block (a parameter's slices run before the blocks, in the update's phase where no gradient
  reads them);
- the stacked outputs ``ys`` are kept as their ``L`` slices: a later unrolled scan that scans them (the
  backward pass reading the forward's residuals) reads slice ``j`` directly, so no residual is ever
  stacked and sliced across blocks; any other reader gets them stacked where it runs, in its phase and
  scope (the weight gradients stacked for the optimizer, after the blocks): a ``concatenate`` of the slices
  each given a leading axis, bare primitives that fuse into an elementwise reader such as the optimizer's
  update (``jnp.stack`` is a call of its own, priced as a kernel that writes the whole stack).

The numbers are the step's: every value is computed by the same primitives on the same operands.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import jax
from jax.extend.core import Literal

from autoshard.trace import jaxpr_compat as jc
from autoshard.trace.graph import Graph, Op, Role
from autoshard.trace.tracer import graph_of_jaxpr

log = logging.getLogger("autoshard")


def layer_stacks(graph: Graph) -> list[int]:
    """The ids of the scans ``unroll_layer_stacks`` unrolls (see the module docstring), in op order."""
    unrolled: set[int] = set()  # stacked outputs of scans chosen so far
    found = []
    for op in graph.ops:
        if op.primitive != "scan" or (op.trip_count or 0) < 2 or not op.bodies:
            continue
        lay = jc.scan_layout(op.eqn)
        xs = op.inputs[lay.stacked_from:]
        if any(graph.tensors[t].role is Role.PARAM or t in unrolled for t in xs):
            found.append(op.id)
            unrolled.update(op.outputs[lay.num_carry:])
    return found


def _stack_name(op: Op) -> str:
    """The scope component the body's ops sit in below the scan's own scope (flax's ``nn.scan`` module
    name), or ``layer`` when they sit in none."""
    base = op.scope + "/" if op.scope else ""
    names = Counter(o.scope[len(base):].split("/")[0] for o in op.bodies[0].ops
                    if o.scope.startswith(base) and len(o.scope) > len(base))
    return names.most_common(1)[0][0] if names else "layer"


def _scope_at(op: Op, inner: Op, stack: str, j: int) -> str:
    """``inner``'s scope (an op of ``op``'s body) as iteration ``j``'s block: ``<scan scope>/<stack>_j/...``."""
    base = [p for p in op.scope.split("/") if p]
    rel = inner.scope[len(op.scope):] if inner.scope.startswith(op.scope) else inner.scope
    parts = [p for p in rel.split("/") if p]
    if parts and parts[0] == stack:
        parts = parts[1:]
    return "/".join([*base, f"{stack}_{j}", *parts])


def _bind(op: Op, invals: list[Any], scope: str | None = None, phase: str | None = None) -> list[Any]:
    eqn = op.eqn
    subfuns, params = jc.bind_params(eqn)
    with jc.eqn_context(eqn, phase or op.phase, scope if scope is not None else op.scope):
        outs = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _hoisted(graph: Graph, stacks: set[int]) -> set[int]:
    """Ops outside the stacks whose results only the stacks read, as constants of their bodies, directly or
    through other such ops: what JAX hoisted out of the scanned body (a causal mask, broadcast LayerNorm
    parameters). Their scopes are the body's own (``blocks/ln_1``) and they belong to every layer."""
    const_of: dict[int, set[int]] = {}
    for i in stacks:
        op = graph.ops[i]
        const_of[i] = set(op.inputs[:jc.scan_layout(op.eqn).num_consts])
    outputs = set(graph.outputs)
    found: set[int] = set()
    for op in reversed(graph.ops):
        if op.id in stacks or not op.outputs or op.bodies:
            continue
        if all(t not in outputs and graph.tensors[t].consumers and all(
                c in found or (c in stacks and t in const_of[c]) for c in graph.tensors[t].consumers)
               for t in op.outputs):
            found.add(op.id)
    return found


def unroll_layer_stacks(graph: Graph, why: str = "for the pipeline") -> Graph:
    """``graph`` with its layer-stack scans (``layer_stacks``) unrolled into numbered blocks (see the module
    docstring); ``graph`` itself when it has none. ``why``: the end of the log line that says so."""
    stacks = set(layer_stacks(graph))
    if not stacks:
        return graph
    consts = graph.constants
    hoisted = _hoisted(graph, stacks)

    def step(*args: Any) -> list[Any]:
        env: dict[int, Any] = dict(zip(graph.inputs, args, strict=True))
        slices: dict[int, list[Any]] = {}  # stacked output of an unrolled scan -> its per-iteration values
        cut: dict[tuple[int, int], Any] = {}  # (stacked input, j) -> its slice j

        def read(tid: int, atom: Any, reader: Op | None) -> Any:
            if isinstance(atom, Literal):
                return atom.val
            if tid in env:
                return env[tid]
            if tid in slices:  # stacked for a reader that is not an unrolled scan, in its phase and scope
                with jc.phase_scope(reader.phase if reader is not None else "other",
                                    reader.scope if reader is not None else ""):
                    env[tid] = jax.lax.concatenate([jax.lax.expand_dims(x, (0,)) for x in slices[tid]], 0)
                return env[tid]
            return consts[tid]

        def at(tid: int, atom: Any, j: int) -> Any:
            if tid in slices:
                return slices[tid][j]
            if (tid, j) not in cut:
                x = read(tid, atom, None)
                with jc.phase_scope("other", ""):
                    cut[(tid, j)] = jax.lax.index_in_dim(x, j, 0, keepdims=False)
            return cut[(tid, j)]

        def again(tid: int, atom: Any, op: Op, stack: str, j: int, made: dict[int, Any]) -> Any:
            """A constant of ``op``'s body that a hoisted op makes, made again inside block ``j``."""
            p = graph.tensors[tid].producer if not isinstance(atom, Literal) else None
            if p is None or p not in hoisted:
                return read(tid, atom, op)
            if tid not in made:
                h = graph.ops[p]
                ins = [again(t, a, op, stack, j, made) for t, a in zip(h.inputs, h.eqn.invars, strict=True)]
                made.update(zip(h.outputs, _bind(h, ins, _scope_at(op, h, stack, j), op.phase), strict=True))
            return made[tid]

        for op in graph.ops:
            atoms = op.eqn.invars
            if op.id in hoisted:
                continue
            if op.id not in stacks:
                ins = [read(t, a, op) for t, a in zip(op.inputs, atoms, strict=True)]
                env.update(zip(op.outputs, _bind(op, ins), strict=True))
                continue
            lay = jc.scan_layout(op.eqn)
            body, stack = op.bodies[0], _stack_name(op)
            n0, n1 = lay.num_consts, lay.stacked_from
            carry = [read(t, a, op) for t, a in zip(op.inputs[n0:n1], atoms[n0:n1], strict=True)]
            ys: list[list[Any]] = [[None] * lay.length for _ in op.outputs[lay.num_carry:]]
            for j in (reversed(range(lay.length)) if lay.reverse else range(lay.length)):
                made: dict[int, Any] = {}
                fixed = [again(t, a, op, stack, j, made) for t, a in zip(op.inputs[:n0], atoms[:n0], strict=True)]
                xs = [at(t, a, j) for t, a in zip(op.inputs[n1:], atoms[n1:], strict=True)]
                benv: dict[int, Any] = dict(zip(body.inputs, [*fixed, *carry, *xs], strict=True))
                for inner in body.ops:
                    ins = [a.val if isinstance(a, Literal) else benv[t] if t in benv else body.constants[t]
                           for t, a in zip(inner.inputs, inner.eqn.invars, strict=True)]
                    benv.update(zip(inner.outputs, _bind(inner, ins, _scope_at(op, inner, stack, j)), strict=True))
                outs = [benv[t] if t in benv else body.constants[t] for t in body.outputs]
                carry = outs[:lay.num_carry]
                for k, y in enumerate(outs[lay.num_carry:]):
                    ys[k][j] = y
            env.update(zip(op.outputs[:lay.num_carry], carry, strict=True))
            slices.update(zip(op.outputs[lay.num_carry:], ys, strict=True))
        return [read(t, None, None) for t in graph.outputs]

    closed = jax.make_jaxpr(step)(*graph.jaxpr.in_avals)
    names = [graph.tensors[t].name for t in graph.inputs]
    roles = [graph.tensors[t].role for t in graph.inputs]
    out = graph_of_jaxpr(closed, names, roles, graph.output_names, graph.output_aliases, graph.in_tree,
                         graph.out_tree)
    log.info("%d layer-stack scan(s) unrolled into %d numbered blocks %s", len(stacks),
             len({o.layer for o in out.ops if o.layer}), why)
    return out

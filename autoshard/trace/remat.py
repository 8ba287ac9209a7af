"""Recompute applied to a traced step: a Graph rewritten so that chosen blocks rematerialise their stash.

The traced step is forward and backward already differentiated, so ``jax.checkpoint`` cannot be applied
to it afterwards; this pass does at the jaxpr level what ``jax.checkpoint`` does inside AD. For each block
(a layer tag, ``Op.layer``) given a mode (``trace.recompute.MODES``):

- the *recomputed set* ``R`` is the block's stash (``recompute.stashes``: held values a forward op of the
  block makes and the backward pass reads), less what the mode keeps (``selective``: the weight products'
  outputs, ``recompute.saved_by_selective``) and less any value a backward op reads *before* the block's
  own backward pass begins (the block's output, read by the next block's backward first: it stays, as a
  checkpoint's input would); plus the fused values the backward reads (``trace.buffers``: a cheap
  elementwise output that XLA computes inside its reader's fusion from the producer's operands) whose
  operands, directly or through other fused values, include a value of ``R``: read from the forward pass,
  such a value would keep the original of a recomputed value (the MLP's pre-activation, say) live until
  the block's backward, undoing the saving;
- the *replay* is the block's forward ops that produce ``R`` or the values ``R`` is computed from, back to
  the values that stay (the block's inputs, what the mode keeps, anything made outside the block);
- at the block's first backward op, the replay runs again on the values that stay, passed through
  ``jax.lax.optimization_barrier`` together with a value the backward op reads (the incoming cotangent),
  so that XLA neither merges the copy with the forward (CSE) nor runs it before the backward needs it;
  every backward op from there reads the replayed values. The forward's copies die after their last
  forward reader.

The result is an ordinary Graph (traced again from the rewritten jaxpr, with the step's input and output
names, roles and pytrees), so the planner prices the extra forward work and the shorter live ranges with
its own rules (``trace.buffers``: the replayed values live only during the block's backward), and the
emitter emits it like any step: numerics are those of the original step (the replay computes the same
values).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import jax
from jax.extend.core import Literal

from autoshard.errors import TraceError
from autoshard.trace import jaxpr_compat as jc
from autoshard.trace.buffers import buffers
from autoshard.trace.graph import Graph, Op
from autoshard.trace.recompute import MODES, saved_by_selective, stashes
from autoshard.trace.tracer import graph_of_jaxpr

log = logging.getLogger("autoshard")


def blocks(graph: Graph) -> list[str]:
    """The step's recomputable blocks (layer tags with a stash), in forward order."""
    return list(stashes(graph))


def _plan(graph: Graph, modes: Mapping[str, str]) -> dict[int, tuple[list[int], set[int]]]:
    """First backward op of each recomputed block -> (replay op ids in order, recomputed tensor ids)."""
    buf = buffers(graph)
    stash = stashes(graph, buf)
    read_back = _read_by_backward(graph)
    first_bwd: dict[str, int] = {}
    for op in graph.ops:
        if op.phase == "backward" and op.layer and op.layer not in first_bwd:
            first_bwd[op.layer] = op.id
    outputs = set(graph.outputs)
    out: dict[int, tuple[list[int], set[int]]] = {}
    for layer, mode in modes.items():
        if mode not in MODES:
            raise TraceError(f"recompute mode {mode!r} for block {layer!r}: expected one of {', '.join(MODES)}")
        if mode == "none" or layer not in stash or layer not in first_bwd:
            continue
        again = first_bwd[layer]

        def kept(tid: int, layer: str = layer, mode: str = mode) -> bool:
            t = graph.tensors[tid]
            if t.producer is None:
                return True
            op = graph.ops[t.producer]
            return (op.layer != layer or op.phase != "forward"
                    or (mode == "selective" and saved_by_selective(op)))

        def late(tid: int, again: int = again) -> bool:
            return (tid not in outputs
                    and not any(graph.ops[c].phase == "backward" and c < again for c in graph.tensors[tid].consumers))

        recomputed = {tid for tid in stash[layer] if not kept(tid) and late(tid)}
        drags: dict[int, bool] = {}

        def dragging(tid: int, drags: dict[int, bool] = drags, recomputed: set[int] = recomputed) -> bool:
            """Whether fused value ``tid``, read in the backward, would keep a recomputed value alive (its
            operands, through other fused values, include one)."""
            if tid not in drags:
                drags[tid] = False  # (a cycle cannot occur; this only stops a revisit)
                op = graph.ops[graph.tensors[tid].producer]  # type: ignore[index]
                drags[tid] = any(i in recomputed or (not buf.held[i] and not kept(i) and dragging(i))
                                 for i in op.inputs)
            return drags[tid]

        recomputed |= {tid for tid in read_back.get(layer, ())
                       if not buf.held[tid] and not kept(tid) and late(tid) and dragging(tid)}
        if not recomputed:
            continue
        replay: set[int] = set()
        todo = [graph.tensors[t].producer for t in recomputed]
        while todo:
            o = todo.pop()
            if o is None or o in replay:
                continue
            replay.add(o)
            todo += [graph.tensors[i].producer for i in graph.ops[o].inputs if not kept(i)]
        produced = {t for o in replay for t in graph.ops[o].outputs}
        out[again] = (sorted(replay), produced)
    return out


def _read_by_backward(graph: Graph) -> dict[str, set[int]]:
    """Block tag -> the values its forward ops make that a backward op reads, held or fused."""
    out: dict[str, set[int]] = {}
    for op in graph.ops:
        if op.phase != "backward":
            continue
        for tid in op.inputs:
            p = graph.tensors[tid].producer
            if p is not None and graph.ops[p].phase == "forward" and graph.ops[p].layer:
                out.setdefault(graph.ops[p].layer, set()).add(tid)
    return out


def rematerialize(graph: Graph, modes: Mapping[str, str]) -> Graph:
    """``graph`` with each block of ``modes`` (block tag -> ``none``/``selective``/``full``) recomputed in
    its backward pass (see the module docstring). Blocks not named, and ``none``, are left as traced."""
    plan = _plan(graph, modes)
    if not plan:
        return graph
    ops = graph.ops
    consts = graph.constants

    def bind(op: Op, invals: list[Any], phase: str | None = None) -> list[Any]:
        """``op`` bound again with its scope and phase (``phase`` overrides it: a replayed forward op runs
        in the backward pass, and a pipeline puts it in the backward program by its phase)."""
        eqn = op.eqn
        subfuns, params = jc.bind_params(eqn)
        with jc.eqn_context(eqn, phase or op.phase, op.scope):
            outs = eqn.primitive.bind(*subfuns, *invals, **params)
        return list(outs) if eqn.primitive.multiple_results else [outs]

    def step(*args: Any) -> list[Any]:
        env: dict[int, Any] = dict(zip(graph.inputs, args, strict=True))
        again: dict[int, Any] = {}  # replayed values, read by backward ops

        def read(tid: int, atom: Any, backward: bool) -> Any:
            if isinstance(atom, Literal):
                return atom.val
            if backward and tid in again:
                return again[tid]
            if tid in env:
                return env[tid]
            return consts[tid]

        for op in ops:
            backward = op.phase == "backward"
            if op.id in plan:
                replay, produced = plan[op.id]
                anchor = next((read(t, a, True) for t, a in zip(op.inputs, op.eqn.invars, strict=True)
                               if not isinstance(a, Literal) and graph.tensors[t].producer is not None
                               and ops[graph.tensors[t].producer].phase == "backward"), None)
                stay = sorted({t for o in replay for t, a in zip(ops[o].inputs, ops[o].eqn.invars, strict=True)
                               if t not in produced and not isinstance(a, Literal)})
                vals = [read(t, None, False) for t in stay]
                with jc.phase_scope("backward", op.layer or op.scope):
                    if anchor is not None:
                        *vals, _ = jax.lax.optimization_barrier((*vals, anchor))
                    else:
                        vals = list(jax.lax.optimization_barrier(tuple(vals)))
                local = dict(zip(stay, vals, strict=True))
                for o in replay:
                    rop = ops[o]
                    ins = [a.val if isinstance(a, Literal) else local[t] if t in local else again[t]
                           if t in again else read(t, a, False) for t, a in zip(rop.inputs, rop.eqn.invars, strict=True)]
                    for t, x in zip(rop.outputs, bind(rop, ins, "backward"), strict=True):
                        again[t] = x
            invals = [read(t, a, backward) for t, a in zip(op.inputs, op.eqn.invars, strict=True)]
            for t, x in zip(op.outputs, bind(op, invals), strict=True):
                env[t] = x
        return [env[t] if t in env else consts[t] for t in graph.outputs]

    closed = jax.make_jaxpr(step)(*graph.jaxpr.in_avals)
    names = [graph.tensors[t].name for t in graph.inputs]
    roles = [graph.tensors[t].role for t in graph.inputs]
    out = graph_of_jaxpr(closed, names, roles, graph.output_names, graph.output_aliases, graph.in_tree,
                         graph.out_tree)
    log.info("autoshard: recompute: %d blocks replay %d ops in their backward pass", len(plan),
             sum(len(r) for r, _ in plan.values()))
    return out


def uniform(graph: Graph, mode: str, first: int | None = None) -> dict[str, str]:
    """``mode`` for every block (or the ``first`` ones in forward order), ``none`` for the rest."""
    names = blocks(graph)
    k = len(names) if first is None else first
    return {b: (mode if i < k else "none") for i, b in enumerate(names)}

"""Cut a traced train step into what runs per microbatch and what runs per step, layers, and stages.

The step is traced at *microbatch* size. Its ops fall in two parts:

- **microbatched** ``P``: the forward and backward ops (phase ``forward`` / ``backward``, from ``jvp`` and
  ``transpose`` in the name stack) and the batch-independent ``other`` ops that only feed them. They run
  once per microbatch.
- **update** ``U``: everything else (the optimizer, code after ``value_and_grad``). It runs once per step.

The tensors that ``P`` hands to ``U`` or to the step's results (the loss, the gradients, aux values) are
*accumulated*: each is the mean of its per-microbatch values. That is exact when the step's loss is a mean
over the batch's examples and microbatches are equal slices (the usual case, and the one Alpa and
Megatron assume); an op of ``U`` that reads the batch directly cannot be rewritten that way and is
refused with an error naming it.

Layers: the forward ops of ``P`` in schedule order are cut into ``L`` contiguous layers by
``solvers.inter_op.cluster_layers`` (Alpa §5.2: balanced flops, little traffic across cuts). Every other op
takes a layer by the *min rule*: ``layer(v) = min { layer(producer(t)) : t ∈ inputs(v), t produced in the
step }`` (step inputs such as parameters do not count); an op with no produced input takes the smallest
layer among its consumers (or 0). The rule keeps every backward dependency pointing from a higher or
equal layer to a lower one, so backward programs of stage ``s`` only wait on stages ``≥ s``.

The *replay rule* comes first for the op where a block's recompute starts in the backward pass (the
``optimization_barrier`` of ``trace.remat``'s replay, or a ``remat``/``checkpoint`` op) inside a
block (``op.layer``: ``trace.structure``'s) whose forward ops start in layer ``f``: ``layer(v) = min({f} ∪
{ layer(producer(t)) : t ∈ inputs(v), produced by a non-forward op })``; the block's backward, which
reads the replay's values, then follows by the min rule. The replay reads
the block's input, produced by the layer before, and the min rule would put it, and with it the whole
backward of block ``k+1`` that reads its values, in layer ``k`` (GPT-1T under full recompute: the first
layer held two blocks' backward, the last none); the rule keeps a block's backward with its forward, as
Megatron does. Reading a lower layer's forward value is a forward-direction dependency (stage ``s``
received it in its forward), and the cotangents still come from layers ``>=`` its own, so the invariant
holds. And a backward op of a block takes at most the last layer of its block's forward ops (the min
rule capped): the op where the cotangent enters a block (the input gradient of
its last matmul reads only that cotangent and a parameter) would otherwise run a layer up, beside the
next block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from autoshard.errors import AutoshardError
from autoshard.trace.graph import Graph, Op, Role, Tensor
from autoshard.trace.jaxpr_compat import REMAT
from autoshard.trace.structure import crossing
from autoshard.trace.tracer import trace
from autoshard.trace.unroll import unroll_layer_stacks
from solvers.inter_op import ClusteringProblem, cluster_layers

log = logging.getLogger("autoshard")

FORWARD, BACKWARD, UPDATE = "forward", "backward", "update"
WEIGHT = "weight"  # the weight-gradient part of a backward, run as its own program (zero-bubble schedules)


class PipelineError(AutoshardError, ValueError):
    """The step cannot be pipelined as written (the message says why and what to change)."""


class PipelineDoesNotFit(PipelineError):
    """No cut into stages fits the memory budget (recompute, more microbatches or devices may)."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class StepParts:
    """Which ops run per microbatch and which tensors are accumulated across microbatches."""

    kind: tuple[str, ...]  # per op id: "forward", "backward" or "update"
    accumulated: tuple[int, ...]  # tensor ids averaged over microbatches (in first-use order)
    batch_inputs: tuple[int, ...]  # positions in graph.inputs split along dimension 0

    def ops(self, kind: str) -> list[int]:
        return [i for i, k in enumerate(self.kind) if k == kind]


def split_step(graph: Graph) -> StepParts:
    """Split ``graph`` into its microbatched part and its update part (see the module docstring)."""
    n = len(graph.ops)
    batch = {tid for tid in graph.inputs if graph.tensors[tid].role is Role.BATCH}
    if not batch:
        raise PipelineError(
            "the step has no batch input (no argument leaf that the step only reads, with the batch's leading "
            "dimension): pipelining splits the batch into microbatches along dimension 0; mark the batch with "
            "batch_argnums=(<position>,) or roles={'<path>': 'batch'}"
        )
    grad_ops = [op for op in graph.ops if op.phase in (FORWARD, BACKWARD)]
    if not any(op.phase == BACKWARD for op in grad_ops):
        raise PipelineError(
            "the step computes no gradient (no jax.grad / jax.value_and_grad found in its trace): there is "
            "no backward pass to pipeline; plan it without microbatches"
        )
    kind = [UPDATE] * n
    for op in grad_ops:
        kind[op.id] = op.phase
    # Batch-independent ops outside the gradient that only feed the microbatched part run with it.
    for op in reversed(graph.ops):
        if kind[op.id] != UPDATE or any(graph.tensors[t].producer is not None and
                                          kind[graph.tensors[t].producer] != UPDATE for t in op.inputs):
            continue
        outs = [graph.tensors[t] for t in op.outputs]
        if outs and all(t.consumers and all(kind[c] != UPDATE for c in t.consumers) and t.id not in graph.outputs
                        for t in outs):
            kind[op.id] = FORWARD
    # Ops that read neither the batch nor any value of the gradient computation and feed the microbatched part
    # as well as the update (a key split: one half for dropout, the other returned in the state) run with the
    # microbatches too: what they hand the update is the same for every microbatch.
    def free_value(t: int) -> bool:
        p = graph.tensors[t].producer
        return t not in batch if p is None else p in free

    free: set[int] = set()
    for op in graph.ops:
        if all(free_value(t) for t in op.inputs):
            free.add(op.id)
    # Ops outside the gradient that read the batch or a value with a row per example made by the microbatched
    # part (the logits a loss returns as aux) compute per-example metrics (accuracy from the logits and the
    # labels, as flax's examples write it): they run with the microbatches too, and what they hand on is
    # averaged over microbatches like the loss (exact for a mean over examples), so long as they read no
    # gradient and nothing the update makes.
    rows = {graph.tensors[t].shape[0] for t in batch if graph.tensors[t].shape}
    per_example = set(batch)
    if len(rows) == 1:
        R = next(iter(rows))
        from_batch = set(batch)
        for op in graph.ops:
            if any(t in from_batch for t in op.inputs):
                from_batch.update(op.outputs)
        moved: list[int] = []
        for op in graph.ops:
            if kind[op.id] != UPDATE:
                per_example.update(t for t in op.outputs if t in from_batch and (graph.tensors[t].shape or (0,))[0] == R)
                continue
            if not any(t in per_example for t in op.inputs):
                continue
            made = [graph.tensors[t].producer for t in op.inputs]
            if all(p is None or kind[p] == FORWARD or p in free for p in made):
                kind[op.id] = FORWARD
                moved.append(op.id)
                per_example.update(t for t in op.outputs if (graph.tensors[t].shape or (0,))[0] == R)
        # what they hand on must be a mean over the microbatch's rows (a division by a multiple of them), which
        # averaging microbatches keeps exact; a sum (jnp.sum(batch["x"])) would be averaged into 1/M of itself:
        # then none runs per microbatch, and the batch read is refused below
        inside = set(moved)
        handed = [t for i in moved for t in graph.ops[i].outputs
                  if t in graph.outputs or any(c not in inside and kind[c] == UPDATE for c in graph.tensors[t].consumers)]
        if not all(_mean_over_rows(graph, t, R, inside) for t in handed):
            for i in moved:
                kind[i] = UPDATE
    # (after the metrics, whose free inputs then run with them too)
    for op in reversed(graph.ops):  # consumers first: a chain of them (wrap, split, unwrap) moves whole
        if kind[op.id] == UPDATE and op.id in free and any(
                kind[c] != UPDATE for t in op.outputs for c in graph.tensors[t].consumers):
            kind[op.id] = FORWARD
    # Batch inputs must reach the update part only through accumulated values.
    for op in graph.ops:
        if kind[op.id] == UPDATE:
            bad = [graph.tensors[t] for t in op.inputs if t in batch]
            if bad:
                raise PipelineError(
                    f"{op.where()} reads the batch input {bad[0].name!r} outside the gradient computation; a "
                    "pipelined step averages what leaves value_and_grad over microbatches and cannot split "
                    "this op. Compute it inside the loss function and return it as aux, or plan without "
                    "microbatches"
                )
    accumulated: list[int] = []
    seen: set[int] = set()
    outputs = set(graph.outputs)
    for op in graph.ops:
        if kind[op.id] == UPDATE:
            continue
        for t in op.outputs:
            ten = graph.tensors[t]
            if t not in seen and (t in outputs or any(kind[c] == UPDATE for c in ten.consumers)):
                seen.add(t)
                accumulated.append(t)
    for t in graph.outputs:  # a batch input returned as is cannot be averaged either
        if t in batch:
            raise PipelineError(f"the step returns its batch input {graph.tensors[t].name!r}; a pipelined step "
                                "cannot return per-example values")
    # an integer handed on is kept from one microbatch (state such as an RNG counter, the same for each); one
    # made from the batch (a count of its tokens) differs per microbatch, and neither keeping nor averaging it
    # gives what the whole batch gives
    made = set(batch)
    for op in graph.ops:
        if kind[op.id] != UPDATE and any(t in made for t in op.inputs):
            made.update(op.outputs)
    for t in accumulated:
        ten = graph.tensors[t]
        if t in made and not ten.inexact:
            raise PipelineError(
                f"the step hands on {ten.name!r} ({ten.dtype}) from the microbatched part (the gradient computation "
                "and what runs with it), an integer made from the batch (a count of its tokens): a pipeline keeps "
                "an integer from one microbatch and averages floats, so it would be one microbatch's count. Return "
                "a mean over the batch's rows instead, or plan without microbatches (runtime='mpmd' does not help)")
    positions = tuple(i for i, t in enumerate(graph.inputs) if t in batch)
    _warn_if_normalised_by_the_batch(graph, accumulated, batch)
    return StepParts(kind=tuple(kind), accumulated=tuple(accumulated), batch_inputs=positions)


def _mean_over_rows(graph: Graph, t: int, rows: int, inside: set[int]) -> bool:
    """Whether ``t``, handed from ops run per microbatch (``inside``) to the update, is a mean over the
    microbatch's rows: made by dividing by a constant multiple of ``rows`` (``jnp.mean`` over its rows, or its
    rows and tokens), or a sum that every op outside divides so (the update then divides the average of the
    microbatches' sums, which is as exact)."""
    def divides_by_rows(op_id: int | None, numerator: int | None = None) -> bool:
        if op_id is None or graph.ops[op_id].primitive != "div":
            return False
        op = graph.ops[op_id]
        if numerator is not None and op.inputs[0] != numerator:
            return False
        val = graph.constant_value(op, 1)
        if val is None or np.size(val) != 1:
            return False
        v = float(np.asarray(val).reshape(()))
        return v > 0 and v == int(v) and int(v) % rows == 0

    if divides_by_rows(graph.tensors[t].producer):
        return True
    outside = [c for c in graph.tensors[t].consumers if c not in inside]
    return t not in graph.outputs and bool(outside) and all(divides_by_rows(c, t) for c in outside)


def _warn_if_normalised_by_the_batch(graph: Graph, accumulated: Sequence[int], batch: set[int]) -> None:
    """Warn (once per graph) when an accumulated scalar, the loss, is divided by a count made from the batch
    (``jnp.sum(mask)``, the tokens that are not padding): averaging equal microbatches weighs each alike, so a
    microbatch with fewer tokens counts more than in the unpipelined step."""
    memo = graph.memo("pipeline.partition.normalised")
    if memo:
        return
    memo["done"] = True
    from_batch: dict[int, bool] = {}

    def reads_batch(t: int) -> bool:
        todo, seen = [t], set()
        while todo:
            x = todo.pop()
            if x in batch:
                return True
            p = graph.tensors[x].producer
            if p is None or p in seen:
                continue
            seen.add(p)
            todo.extend(graph.ops[p].inputs)
        return False

    for t in accumulated:
        p = graph.tensors[t].producer
        if graph.tensors[t].shape or p is None or graph.ops[p].primitive != "div":
            continue
        den = graph.ops[p].inputs[1]
        if graph.tensors[den].producer is not None and from_batch.setdefault(den, reads_batch(den)):
            op = graph.ops[p]
            log.warning("%s divides the step's %r by a count made from the batch (a number of tokens that are not "
                        "padding, say): the pipeline averages equal microbatches, weighing each alike, so its "
                        "loss and gradients differ from the step's where microbatches hold different counts. "
                        "Normalise by a number fixed ahead (the tokens of a full batch) or per example to make "
                        "the pipelined step exact", op.where(), graph.tensors[t].name)


# ---- layers ----------------------------------------------------------------------------------------------


def forward_sequence(graph: Graph, parts: StepParts) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The forward ops in schedule order, their flops, and the bytes live across each cut between them
    (produced by a forward op at or before the cut, read by a forward op after it)."""
    fwd = parts.ops(FORWARD)
    flops = np.array([graph.ops[i].flops for i in fwd], dtype=np.float64)
    cut = crossing(graph, fwd, lambda t: t.nbytes)[1: max(len(fwd), 1)]
    return fwd, flops, cut


STAGE_SCOPE = "autoshard_stage_"


def pipeline_stage(name: str | int) -> contextlib.AbstractContextManager:
    """Mark a region of the model: ``with autoshard.pipeline_stage("encoder"): ...``.

    A named scope (``autoshard_stage_<name>``); where consecutive forward ops change region, a layer
    must end, so the layer clustering (and hence every stage boundary) respects the user's cut. With as
    many layers as regions (``num_layers=``), the regions are the layers."""
    return jax.named_scope(f"{STAGE_SCOPE}{name}")


def marked_boundaries(graph: Graph, fwd: Sequence[int]) -> list[int]:
    """Forward-op positions after which the user's ``pipeline_stage`` region changes."""

    def region(op_id: int) -> str | None:
        for part in graph.ops[op_id].scope.split("/"):
            if part.startswith(STAGE_SCOPE):
                return part
        return None

    tags = [region(i) for i in fwd]
    return [k for k in range(len(fwd) - 1) if tags[k] != tags[k + 1] and tags[k + 1] is not None
            and (tags[k] is not None or any(t is not None for t in tags[:k + 1]))]


def batch_rows(graph: Graph) -> int:
    """The rows the step's batch inputs share (dimension 0), 0 if it has none."""
    rows = 0
    for tid in graph.inputs:
        t = graph.tensors[tid]
        if t.role.value == "batch" and t.shape:
            rows = math.gcd(rows, t.shape[0])
    return rows


# GPT-1T's 128 blocks on 384 hosts: Megatron's layout (two one-block chunks per 6-host stage) and the
# automatic plan's (a block per 3-host stage) need a layer per block, which 64 layers of two blocks cannot
# express; layer prices cost a solve per distinct layer, and the stage DP (L² ranges) took 8-15 s at 129
MAX_DEFAULT_LAYERS = 160


def default_num_layers(graph: Graph, parts: StepParts) -> int:
    """One layer per repeated block (``trace.structure``), plus one for the ops around them, between 2 and
    ``MAX_DEFAULT_LAYERS``; 8 when the step has no blocks."""
    tags = {graph.ops[i].layer for i in parts.ops(FORWARD) if graph.ops[i].layer}
    return max(2, min(MAX_DEFAULT_LAYERS, len(tags) + 1)) if tags else 8


def assign_layers(graph: Graph, parts: StepParts, num_layers: int | None = None, *,
                  forced: Iterable[int] = ()) -> tuple[int, ...]:
    """A layer for every op: forward ops by clustering, the rest by the min rule (module docstring).

    ``num_layers`` defaults to ``default_num_layers``; ``forced``: forward-op positions after which a
    layer must end (user stage boundaries)."""
    fwd, flops, cut = forward_sequence(graph, parts)
    if not fwd:
        raise PipelineError("the step has no forward ops to cut into layers")
    num_layers = num_layers or default_num_layers(graph, parts)
    forced = sorted({*forced, *marked_boundaries(graph, fwd)})
    return propagate_layers(graph, fwd, cluster_forward(flops, cut, num_layers, forced))


def cluster_forward(flops: np.ndarray, cut: np.ndarray, num_layers: int, forced: Iterable[int] = ()) -> np.ndarray:
    """The layer of each forward op: Alpa's clustering (``solvers.inter_op.cluster_layers``), run piecewise.

    An op heavier than a mean layer (``F / L``; a language model's output projection) is a layer of its
    own, with the light ops right after it that weigh less than half a layer; forced boundaries also
    split the chain. The ``L`` layers are shared among the pieces in proportion to their flops (largest
    remainder, at least one each) and each piece is clustered on its own: one heavy op can then no
    longer force the balance cap so wide that near-empty layers at cheap cuts win."""
    n = flops.shape[0]
    L = max(1, min(num_layers, n))
    total = float(flops.sum()) or 1.0
    mean = total / L
    forced_set = {int(p) for p in forced if 0 <= int(p) < n - 1}
    cuts = sorted(forced_set)
    heavy = [k for k in range(n) if flops[k] > mean]
    for k in heavy:
        cuts += [k - 1, k] if k > 0 else [k]
    bounds = sorted({c for c in cuts if 0 <= c < n - 1})
    pieces = [(a + 1, b + 1) for a, b in zip([-1, *bounds], [*bounds, n - 1], strict=True)]  # [start, end)
    # light crumbs after a heavy op (or at either end) join their neighbour instead of taking a layer
    merged: list[list[int]] = []
    for a, b in pieces:
        light = float(flops[a:b].sum()) < 0.5 * mean and not any(a <= k < b for k in heavy)
        if merged and light and (a - 1) not in forced_set:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    if (len(merged) > 1 and float(flops[merged[0][0]:merged[0][1]].sum()) < 0.5 * mean
            and merged[0][1] - 1 not in forced_set):
        merged[1][0] = merged[0][0]
        merged.pop(0)
    weights = np.array([float(flops[a:b].sum()) for a, b in merged])
    fixed = np.array([any(a <= k < b for k in heavy) for a, b in merged])
    share = np.ones(len(merged), dtype=np.int64)
    spare = L - len(merged)
    if spare > 0 and (~fixed).any():
        w = np.where(fixed, 0.0, weights)
        ideal = w / w.sum() * (spare + int((~fixed).sum()))
        share = np.where(fixed, 1, np.maximum(1, np.floor(ideal).astype(np.int64)))
        rest = L - int(share.sum())
        order = np.argsort(-(ideal - np.floor(ideal)) + fixed * 1e9)
        for i in order[:max(rest, 0)]:
            share[i] += 1
    out = np.empty(n, dtype=np.int64)
    base = 0
    for (a, b), k in zip(merged, share.tolist(), strict=True):
        k = max(1, min(k, b - a))
        if k == 1:
            out[a:b] = base
        else:
            part = cluster_layers(ClusteringProblem(flops=flops[a:b], cut_bytes=cut[a:b - 1], num_layers=k))
            out[a:b] = base + part.layer_of(b - a)
        base += k
    return out


def propagate_layers(graph: Graph, fwd: Sequence[int], fwd_layer: Sequence[int]) -> tuple[int, ...]:
    """Layers of all ops from those of the forward ops ``fwd`` (the min rule and the replay rule of the
    module docstring)."""
    layer = [-1] * len(graph.ops)
    forward = set(fwd)
    block_start: dict[str, int] = {}  # a block -> the first layer of its forward ops
    block_end: dict[str, int] = {}  # a block -> the last layer of its forward ops
    for k, op_id in enumerate(fwd):
        layer[op_id] = int(fwd_layer[k])
        op = graph.ops[op_id]
        if op.layer:
            block_start[op.layer] = min(block_start.get(op.layer, layer[op_id]), layer[op_id])
            block_end[op.layer] = max(block_end.get(op.layer, layer[op_id]), layer[op_id])
    for op in graph.ops:
        if layer[op.id] >= 0:
            continue
        producers = [graph.tensors[t].producer for t in op.inputs if graph.tensors[t].producer is not None]
        replay = op.primitive == "optimization_barrier" or op.primitive in REMAT
        if replay and op.layer in block_start and op.phase == "backward":  # the replay rule
            layer[op.id] = min([block_start[op.layer],
                                *(layer[p] for p in producers if p not in forward and layer[p] >= 0)])
            continue
        srcs = [s for s in (layer[p] for p in producers) if s >= 0]
        if op.phase == "backward" and op.layer in block_end:  # never above its own block's forward
            srcs.append(block_end[op.layer])
        if srcs:
            layer[op.id] = min(srcs)
    for op in reversed(graph.ops):  # ops fed only by step inputs and constants: their earliest consumer
        if layer[op.id] >= 0:
            continue
        users = [layer[c] for t in op.outputs for c in graph.tensors[t].consumers if layer[c] >= 0]
        layer[op.id] = min(users) if users else 0
    return tuple(layer)


# ---- sub-graphs ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class SubGraph:
    """Some ops of a step as a Graph of their own (renumbered), plus the maps back to the step's ids."""

    graph: Graph
    ops: tuple[int, ...]  # sub op id -> step op id
    tensors: tuple[int, ...]  # sub tensor id -> step tensor id


def boundary(graph: Graph, op_ids: Sequence[int], keep: Collection[int] = ()) -> tuple[list[int], list[int]]:
    """What a set of ops exchanges with the rest of the step: the tensors they read that are produced
    elsewhere or are step inputs (constants excluded, but for those in ``keep``), in first-read order, and
    the tensors they produce that something outside reads or the step returns, in schedule order."""
    inside = set(op_ids)
    outputs = set(graph.outputs)
    ins: list[int] = []
    seen: set[int] = set()
    for i in op_ids:
        for t in graph.ops[i].inputs:
            ten = graph.tensors[t]
            if t in seen or (ten.producer is not None and ten.producer in inside):
                continue
            if ten.producer is None and ten.role is Role.CONST and t not in keep:
                continue
            seen.add(t)
            ins.append(t)
    outs = [t for i in op_ids for t in graph.ops[i].outputs
            if t in outputs or any(c not in inside for c in graph.tensors[t].consumers)]
    return ins, outs


def subgraph(graph: Graph, op_ids: Sequence[int]) -> SubGraph:
    """The ops ``op_ids`` (in schedule order) as a Graph whose inputs and outputs are their ``boundary``;
    cut once per set of ops and graph (``Graph.memo``: the layers' pricing and the stages' plans ask for the
    same layers' sub-graphs again and again)."""
    key = tuple(sorted(op_ids))
    cuts = graph.memo("pipeline.partition.subgraph")
    sub = cuts.get(key)
    if sub is None:
        sub = cuts[key] = _cut(graph, key)
    return sub


def _cut(graph: Graph, op_ids: Sequence[int]) -> SubGraph:
    inside = set(op_ids)
    in_tids, out_tids = boundary(graph, op_ids)
    produced = {t for i in op_ids for t in graph.ops[i].outputs}
    consts = sorted({t for i in op_ids for t in graph.ops[i].inputs
                     if graph.tensors[t].producer is None and graph.tensors[t].role is Role.CONST})
    order = [*in_tids, *consts, *sorted(produced)]
    tmap = {t: k for k, t in enumerate(order)}
    omap = {i: k for k, i in enumerate(op_ids)}
    consumers: dict[int, list[int]] = defaultdict(list)
    for i in op_ids:
        for t in graph.ops[i].inputs:
            lst = consumers[tmap[t]]
            if not lst or lst[-1] != omap[i]:
                lst.append(omap[i])
    n_ops = len(op_ids)
    out_set = {tmap[t] for t in out_tids}
    tensors: list[Tensor] = []
    for k, t in enumerate(order):
        ten = graph.tensors[t]
        prod = omap.get(ten.producer) if ten.producer is not None and ten.producer in inside else None
        cons = tuple(consumers.get(k, ()))
        start = 0 if prod is None else prod
        end = n_ops if k in out_set else (cons[-1] + 1 if cons else start + 1)
        role = ten.role
        if prod is None and role is Role.ACTIVATION:
            role = Role.STATE  # an activation from another program arrives as an input
        tensors.append(dataclasses.replace(ten, id=k, producer=prod, consumers=cons, live=(start, max(end, start)),
                                           role=role))
    ops: list[Op] = [
        dataclasses.replace(graph.ops[i], id=omap[i], inputs=tuple(tmap[t] for t in graph.ops[i].inputs),
                            outputs=tuple(tmap[t] for t in graph.ops[i].outputs))
        for i in op_ids
    ]
    sub = Graph(ops=tuple(ops), tensors=tuple(tensors), inputs=tuple(tmap[t] for t in in_tids),
                outputs=tuple(tmap[t] for t in out_tids),
                output_names=tuple(graph.tensors[t].name for t in out_tids))
    return SubGraph(graph=sub, ops=tuple(op_ids), tensors=tuple(order))


# ---- programs ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """Ops of one stage that run as one program: per microbatch (forward/backward) or per step (update)."""

    stage: int
    kind: str
    level: int  # update programs only: order among the stages' update programs (0 first)
    ops: tuple[int, ...]
    inputs: tuple[int, ...]  # step tensor ids read from outside (step inputs or other programs)
    outputs: tuple[int, ...]  # step tensor ids other programs, the accumulators or the results read


def segments(graph: Graph, parts: StepParts, stage_of_op: Sequence[int], *,
             split_weight: bool = False) -> list[Segment]:
    """Group ops into programs: per stage one forward and one backward program, and update programs by
    (stage, level), where an update op's level counts how many times its inputs changed stage on the
    way from the accumulated values (so levels run in order and never wait on a later one).

    ``split_weight`` (zero-bubble schedules): a stage's backward becomes two programs, ``backward`` with
    the ops the other stages' per-microbatch programs wait for (the input gradients, and what they need)
    and ``weight`` with the rest, which only feed the accumulated results (the weight gradients)."""
    level = [0] * len(graph.ops)
    for op in graph.ops:
        if parts.kind[op.id] != UPDATE:
            continue
        lv = 0
        for t in op.inputs:
            p = graph.tensors[t].producer
            if p is not None and parts.kind[p] == UPDATE:
                lv = max(lv, level[p] + (stage_of_op[p] != stage_of_op[op.id]))
        level[op.id] = lv
    groups: dict[tuple[int, str, int], list[int]] = defaultdict(list)
    for op in graph.ops:
        groups[(stage_of_op[op.id], parts.kind[op.id], level[op.id])].append(op.id)
    if split_weight:
        for key in [k for k in groups if k[1] == BACKWARD]:
            needed = input_gradient_ops(graph, parts, groups[key])
            rest = [i for i in groups[key] if i not in needed]
            if rest:
                groups[key] = [i for i in groups[key] if i in needed]
                groups[(key[0], WEIGHT, 0)] = rest
            if not groups[key]:
                del groups[key]
    out: list[Segment] = []
    for (stage, kind, lv), ids in groups.items():
        ins, outs = boundary(graph, ids)
        out.append(Segment(stage=stage, kind=kind, level=lv, ops=tuple(ids), inputs=tuple(ins),
                           outputs=tuple(outs)))
    rank = {FORWARD: 0, BACKWARD: 1, WEIGHT: 2, UPDATE: 3}
    out.sort(key=lambda s: (rank[s.kind], s.level, s.stage if s.kind != BACKWARD else -s.stage))
    return out


def input_gradient_ops(graph: Graph, parts: StepParts, op_ids: Sequence[int]) -> set[int]:
    """The ops of ``op_ids`` (one stage's backward) that other per-microbatch ops wait for, directly or
    through other ops of ``op_ids``: what a zero-bubble schedule's ``B`` pass must run."""
    inside = set(op_ids)
    stack = [i for i in op_ids for t in graph.ops[i].outputs
             if any(c not in inside and parts.kind[c] != UPDATE for c in graph.tensors[t].consumers)]
    needed: set[int] = set()
    while stack:
        i = stack.pop()
        if i in needed:
            continue
        needed.add(i)
        for t in graph.ops[i].inputs:
            p = graph.tensors[t].producer
            if p is not None and p in inside and p not in needed:
                stack.append(p)
    return needed


def microbatch_args(args: Sequence[Any], graph: Graph, parts: StepParts | None = None,
                    num_microbatches: int = 1) -> tuple[Any, ...]:
    """``args`` with every batch leaf cut to its first ``1/num_microbatches`` along dimension 0 (abstract
    leaves become ShapeDtypeStructs of that shape)."""
    leaves, tree = jax.tree_util.tree_flatten(tuple(args))
    batch = parts.batch_inputs if parts is not None else tuple(
        i for i, t in enumerate(graph.inputs) if graph.tensors[t].role.value == "batch")
    out = list(leaves)
    for i in batch:
        x = leaves[i]
        if not np.shape(x):
            raise PipelineError(f"batch input {graph.tensors[graph.inputs[i]].name!r} is a scalar: it has no rows "
                                "to split into microbatches; give it a leading batch dimension, or mark it as "
                                "carried state with roles={'<path>': 'state'}")
        n = x.shape[0]
        if n % num_microbatches:
            raise PipelineError(f"batch input {graph.tensors[graph.inputs[i]].name!r} has {n} rows, not divisible "
                                f"into {num_microbatches} microbatches; pick a microbatch count dividing {n}")
        k = n // num_microbatches
        out[i] = jax.ShapeDtypeStruct((k, *x.shape[1:]), x.dtype) if not hasattr(x, "__array__") or \
            isinstance(x, jax.ShapeDtypeStruct) else x[:k]
    return tuple(jax.tree_util.tree_unflatten(tree, out))


def trace_microbatch(fn: Callable[..., Any], args: Sequence[Any], graph: Graph, num_microbatches: int, *,
                     roles: Mapping[str | int, Any] | None = None) -> Graph:
    """``fn`` traced at microbatch size (``microbatch_args``; ``graph``: its trace at full size), with a layer
    stack written as one scan unrolled into blocks (``trace.unroll``): the graph every pipeline
    pass (stage DP, uniform cut, runtimes) reads."""
    micro = trace(fn, *microbatch_args(args, graph, None, num_microbatches), roles=roles)
    return unroll_layer_stacks(micro)

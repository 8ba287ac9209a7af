"""The planner's pipeline as one SPMD program: a tick loop over a stage axis, for uniform stages.

Where the MPMD runtime (``runtime``) runs one program per stage and action from Python, this module emits
the whole pipelined step as **one** ``jax.jit`` program over the whole mesh, which runs unchanged on one
process or many (``jax.distributed``): the host dispatches one call per step, whatever the number of
stages and microbatches.

The step is first cut into uniform stages (``pipeline.uniform``: the head, ``S`` chunks of identical
blocks, the tail, and what runs before and after them); chunk 0's ops, re-bound, compute any chunk.

The program: ``jax.shard_map`` manual over the stage axis only (the other axes stay automatic, so XLA
lays the stage's work out over them), around a ``lax.scan`` over the ticks of a schedule (``ticks``: a
schedule's unit slots, one action per stage per tick, or fused 1F1B, a forward and a backward per tick). At
tick ``t`` stage ``s`` reads its actions from static tables and runs each under ``lax.cond``: ``F(m)``,
then ``B(m')``.

- ``F(m)``: the chunk's forward on the stream received for ``m`` (stage 0 first runs the head on
  microbatch ``m`` of the batch); its residuals go to a residual buffer slot; the last stage then runs
  the tail's forward and backward at once (the loss and its cotangent), keeping the cotangent for its
  ``B(m)``; other stages send the stream on.
- ``B(m)``: the chunk's backward from its residuals and the received cotangent; the gradients it returns
  are summed into the stage's accumulators; stage 0 then runs the head's backward; other stages send
  the cotangent back.
- every tick ends with two ``ppermute`` on the stage axis: the stream one stage up, the cotangent one
  stage down (zeros where nothing is sent); a received value is stored in the slot the table names.

Buffers are bounded by the schedule, not by ``M``: slots are assigned by interval colouring of each
value's life (written at one tick, read at a later one), so 1F1B holds at most ``S - s`` microbatches'
residuals at stage ``s`` (``Schedule.peak_inflight``), fused 1F1B ``2(S - 1 - s) + 1`` and GPipe ``M``.
Idle ticks skip their work (``lax.cond``) but still exchange zeros; a tick lasts as long as its slowest
stage (``ticks.price``).

After the loop the stacked accumulators come back split over the stage axis, the head's and tail's are
summed over it (one reduction per step: only stages 0 and ``S-1`` hold non-zero sums), each is divided by
``M`` (the mean over microbatches, as ``partition`` defines it), and the update runs on the whole mesh.

Inside a stage the plan's layouts hold: the mesh is ``(stage, *the stage's own axes)`` and every tensor the
stage plans pins its layout there (``with_sharding_constraint`` inside the shard_map, whose other axes stay
automatic); chunk 0's layouts, which the planner found for identical stages, serve every stage.

Interleaved 1F1B (``num_chunks = v``): ``V = v·S`` virtual stages of ``K / V`` blocks, stage ``s`` holding
chunks ``u = c·S + s`` (weights stacked ``[S, v, ...]``), the tables name each action's chunk, the head runs
at ``u = 0`` and the tail at ``u = V − 1``, and the exchanges go round the ring (stage ``S − 1``'s chunk ``c``
feeds stage 0's chunk ``c + 1``).

A layer stack written as one scan arrives unrolled (``trace.unroll``): its blocks read their rows of the
stacked parameters. Those parameters, their optimizer state and the stacked gradients keep their ``[K, ...]``
shape with the rows split over the stage axis (``on_stages``); the stage's weights ``[S, v, ...]`` are a
reshape of them (``uniform.strided_rows``) and the gradients stacked for the optimizer a reshape of the
accumulators (``_stacked_gradients``), so with one chunk a stage nothing moves between stages but the stream.

ZB-H1 (``weight_pass``): each chunk's backward runs as two actions, ``B`` (the ops the cotangent to the chunk
before waits for) and ``W`` (the weight gradients), at the ticks the schedule gives them; what ``W`` reads
of ``B``'s values waits in a buffer of its own, and the residuals and the received cotangent live until
``W``. With ``B`` and ``W`` about a forward each, the lockstep loses little to the asynchronous schedule
(1F1B's unit ticks make a forward wait for a backward elsewhere: up to 4/3 of the work).

ZB-V (``schedules.zb_v``, Qi et al. 2024): two chunks a stage in a V, with ZB-H1's weight pass. Chunk 0 of
stage ``s`` is virtual stage ``s``, chunk 1 is ``2S − 1 − s`` (weights stacked so, ``_by_stage``), so the head
(``u = 0``) and the tail (``u = V − 1``) both run on stage 0, and the turn at the bottom (``S − 1`` to ``S``)
stays on stage ``S − 1``: its stream and cotangent are kept there at the end of the tick, not exchanged.
Chunk 0's stream goes up and its cotangent down, chunk 1's the other way, so a stage hears from both
neighbours in one tick; since it runs one action a tick it sends at most one value each way, and the tick
still ends with two ``ppermute`` (up and down), each carrying a stream or a cotangent (four where their
shapes differ), read into the slot the receive table for that side names (``lowering.Ticks``). At most
``2S`` chunk-microbatches are in flight a stage (until ``W``), each half a stage's layers: 1F1B's
activation memory, with the bubble filled by ``W``. Stage 0 holds the tail beside the head; spread, its
slices run on stages ``0..G−1`` (below).

Gradients are reduced once a step, as the planner prices them: a stage's partial sums over its data-parallel
axes (weight gradients of the chunk, the tail's and the head's, the loss, the embeddings' scatter-adds
into zeros) leave each action unreduced, stacked along a leading dimension split over those axes
(``unreduced``, as the MPMD runtime does), are added up in the loop's accumulators and summed after it.

A spread tail (``Spread``, ``tail=``: the step traced at ``1/G`` of the microbatch's rows): the layers after
the blocks (final norm, LM head, loss: on GPT-1T a sixth of a block) would make every tick in which the last
stage runs a forward that much longer, since all stages wait for it. Instead, at the end of that tick the
stream's rows go out in ``G`` slices to the last ``G`` stages (``G − 1`` ``ppermute``, under a ``lax.cond``
whose predicate is the tick's, the same on every stage); in the next tick each runs the tail's forward and
backward on its slice, before its own actions, adding ``1/G`` of its sums (the loss, the head's gradients:
the step is a mean over rows) to the accumulators; at the end of that tick the slices' cotangents come back,
joined in row order into the last stage's cotangent slot. The schedule leaves that tick between the last
stage's forward and backward (``schedules``' tail gap). The slices' layouts are the plan's where the tail's
ops pair up with the small trace's, else XLA's (JAX traces a dimension of one row differently). In a V
(ZB-V) the last virtual stage runs on stage 0, beside the head, and the slices go to stages ``0..G−1``
(``Ticks.tail_stages``): without the spread every tick in which stage 0 runs its second chunk would carry
the whole tail.

Not yet: blocks that read per-microbatch values other than the residual stream (an attention mask built
from the batch).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.emit.interpret import Interpreter
from autoshard.emit.program import check_leaves, copied_leaves
from autoshard.emit.specs import named_sharding, normalize_key
from autoshard.pipeline.draws import row_draws, top_ops
from autoshard.pipeline.partition import split_step
from autoshard.pipeline.pipeline_plan import PipelinePlan
from autoshard.pipeline.schedules import V_SCHEDULES, PipelineProgram, schedule
from autoshard.pipeline.ticks import DISPATCH_S, SCHEDULES, SpmdTime, cannot_run, price, ticks
from autoshard.pipeline.uniform import (
    Group,
    UniformStages,
    row_of,
    stacked_rows,
    strided_rows,
    uniform_stages,
    weight_pass,
)
from autoshard.pipeline.unreduced import UnreducedInterpreter, plan_stacked, stacked_size
from autoshard.trace.graph import Graph, Role, Scope
from cost_models import ShardingSpec

log = logging.getLogger("autoshard")

STAGE_AXIS = "stage"
BLOCK = -1  # a microbatch's environment: its index, under a key no tensor id takes (``_loop``'s ``run``)
INNER_AXIS = "inner"



# ---- the program ------------------------------------------------------------------------------------------


def on_stages(graph: Graph, cut: UniformStages, specs: dict[int, ShardingSpec], mesh: jax.sharding.Mesh
              ) -> dict[int, ShardingSpec]:
    """``specs`` (the plan's layouts of ``graph``'s top-level tensors) with a layer stack's rows split over the
    stage axis: its parameters ``[K, ...]`` (sliced per block by ``trace.unroll``), and the update's values
    of their shapes (optimizer state, the stacked gradients, the new parameters), stage ``s`` holding rows
    ``s·K/S ..``: with one chunk a stage, its own blocks' rows (the optimizer then updates them in place;
    with chunks, the rows a stage holds and the chunks it runs differ, and the program moves them once a
    step). The stage axis goes before any of the stage's own axes on dimension 0, when the rows divide."""
    S = mesh.shape[STAGE_AXIS]
    shapes = {graph.tensors[x].shape for u in range(cut.num_stages) for j, kind in enumerate(cut.f_kinds)
              if kind == "stacked" and (r := row_of(graph, cut.chunk_f[u].inputs[j])) is not None
              for x in (r[0],)}
    shapes = {sh for sh in shapes if sh[0] % S == 0}
    if not shapes:
        return specs
    update = {t for i in cut.update.ops for t in (*graph.ops[i].inputs, *graph.ops[i].outputs)}
    update |= {graph.inputs[i] for i, t in enumerate(graph.inputs) if graph.tensors[t].shape in shapes
               and graph.tensors[t].role in (Role.PARAM, Role.OPT_STATE)}
    for t in update:
        shape = graph.tensors[t].shape
        if shape not in shapes:
            continue
        spec = specs.get(t) or ShardingSpec.replicated(len(shape))
        first = spec.dims[0]
        size = S * int(np.prod([mesh.shape[a] for a in first]))
        dims0 = (STAGE_AXIS, *first) if shape[0] % size == 0 else (STAGE_AXIS,)
        specs[t] = ShardingSpec(dims=(dims0, *spec.dims[1:]), partial=spec.partial)
    return specs


@dataclasses.dataclass(frozen=True, slots=True)
class Spread:
    """The tail (the layers after the blocks, forward and backward) run on ``split`` stages, each on a slice of
    the microbatch's rows, from ``graph``: the step traced at ``1/split`` of the rows, cut as the step is
    (``cut``). Pairs ``(t1, t2)`` name a tensor of the microbatch's trace and its counterpart in ``graph``:
    ``send`` what the tail reads from the last block (its rows sliced and sent), ``batch`` its batch inputs
    (sliced where it runs), ``outside`` the weights and other values the loop holds whole, ``once`` what the
    tail adds to the step's sums (scaled by ``1/split``); ``cot``: per cotangent channel, the slice's
    tensor the last block's backward reads (joined in row order); ``specs``: the plan's layouts of the tail,
    carried over op by op where the smaller rows still divide."""

    split: int
    graph: Graph
    cut: UniformStages
    send: tuple[tuple[int, int], ...]
    batch: tuple[tuple[int, int], ...]
    outside: tuple[tuple[int, int], ...]
    pre: tuple[int, ...]  # values of ``graph`` made before the loop (``cut.pre``) at the slice's shapes
    once: tuple[tuple[int, int], ...]
    cot: tuple[int, ...]
    specs: dict[Scope, dict[int, ShardingSpec]]
    draws: frozenset[tuple[Scope, int]] | None  # ``graph``'s draws over the rows (``row_draws``; None: not jit's)


def _spread(micro: Graph, cut: UniformStages, small: Graph, batch_pos: Sequence[int],
            top: Mapping[int, ShardingSpec], mesh: jax.sharding.Mesh, full: Graph, num_microbatches: int) -> Spread:
    """``Spread`` of ``cut``'s tail over ``G`` stages, ``small`` being the step traced at ``1/G`` of the
    microbatch's rows. The two traces come from one function, so what the tail exchanges with the rest pairs
    up by position: the last block's outputs and stream inputs, the step's inputs, the values made before
    the loop, the step's outputs and what the update reads. The tail's own ops may differ (JAX traces a
    dimension of size 1 differently): when they pair up in order the plan's layouts carry over to them,
    else XLA lays the slice out. Anything else (a value whose shape is not the rows over ``G``) is refused
    with why. ``full``: the step traced at full size, against which ``small``'s draws over the rows are found
    (``Spread.draws``; ``num_microbatches``: the microbatches of ``micro``)."""
    rows = {micro.tensors[micro.inputs[i]].shape[0] for i in batch_pos}
    small_rows = {small.tensors[small.inputs[i]].shape[0] for i in batch_pos}
    if len(rows) != 1 or len(small_rows) != 1 or next(iter(rows)) % next(iter(small_rows)):
        raise cannot_run(f"a tail spread over stages needs the step traced at a divisor of the microbatch's rows "
                         f"{sorted(rows)}; got {sorted(small_rows)}")
    R, r = next(iter(rows)), next(iter(small_rows))
    G = R // r
    S = mesh.shape[STAGE_AXIS]
    if not 1 < G <= S:
        raise cannot_run(f"a tail spread over {G} stages needs between 2 and the {S} stages")
    draws = row_draws(small, full, num_microbatches * G)  # slice g of microbatch m: rows block m·G + g
    scut = uniform_stages(small, cut.num_stages, split_step(small), top_ops(draws or ()))
    last, slast = cut.chunk_f[-1], scut.chunk_f[-1]
    pairs: dict[int, int] = {}  # the tail's boundary, by position
    for xs, ys in ((last.outputs, slast.outputs), (last.inputs, slast.inputs), (micro.inputs, small.inputs),
                   (cut.pre.outputs, scut.pre.outputs), (micro.outputs, small.outputs),
                   (cut.update.inputs, scut.update.inputs), (cut.post.inputs, scut.post.inputs),
                   (cut.tail_cot, scut.tail_cot)):
        if len(xs) != len(ys):
            raise cannot_run(f"the step traces differently at {r} rows than at {R}: the tail cannot be spread")
        for x, y in zip(xs, ys, strict=True):
            pairs.setdefault(x, y)
    last_f = cut.from_last_block()
    batch_of = {micro.inputs[i]: small.inputs[i] for i in batch_pos}

    def reads(c: UniformStages) -> list[int]:
        return list(dict.fromkeys([*c.tail_f.inputs, *(t for t in c.tail_b.inputs if t not in c.tail_f.outputs)]))

    send, batch, outside, pre = [], [], [], []
    for t1 in reads(cut):
        t2 = pairs.get(t1)
        if t2 is None:
            raise cannot_run(f"the tail reads {micro.tensors[t1].name!r}, which has no counterpart at {r} rows")
        big, sm = micro.tensors[t1].shape, small.tensors[t2].shape
        if t1 in last_f or t1 in batch_of:
            if not big or big[0] != R or sm != (r, *big[1:]):
                raise cannot_run(f"the tail reads {micro.tensors[t1].name!r} {big}, whose first dimension is not the "
                                 f"microbatch's {R} rows: it cannot be split over stages")
            (batch if t1 in batch_of else send).append((t1, t2))
        elif big != sm and t2 in scut.pre.outputs:  # made outside the loop from the weights (a broadcast)
            pre.append(t2)
        elif big != sm:
            raise cannot_run(f"the tail reads {micro.tensors[t1].name!r}, shaped {big} at {R} rows and {sm} at {r}, "
                             "from outside the blocks: it cannot be split over stages")
        else:
            outside.append((t1, t2))
    if {t2 for _, t2 in (*send, *batch, *outside)} | set(pre) != set(reads(scut)):
        raise cannot_run(f"the layers after the blocks read other values at {r} rows than at {R}")
    made = {t for grp in (scut.tail_f, scut.tail_b) for t in grp.outputs}
    once = tuple((t1, pairs.get(t1, -1)) for grp in (cut.tail_f, cut.tail_b) for t1 in grp.outputs
                 if t1 in cut.accumulated)
    if any(t2 not in made for _, t2 in once) or any(t not in made for t in scut.tail_cot):
        raise cannot_run(f"the layers after the blocks return other values at {r} rows than at {R}")
    sizes = {a: mesh.shape[a] for a in mesh.axis_names}
    specs: dict[int, ShardingSpec] = {}
    ops1 = [micro.ops[i] for grp in (cut.tail_f, cut.tail_b) for i in grp.ops]
    ops2 = [small.ops[i] for grp in (scut.tail_f, scut.tail_b) for i in grp.ops]
    if [o.primitive for o in ops1] == [o.primitive for o in ops2]:  # the plan's layouts, op by op
        for o1, o2 in zip(ops1, ops2, strict=True):
            for x, y in zip((*o1.inputs, *o1.outputs), (*o2.inputs, *o2.outputs), strict=False):
                spec = top.get(x)
                if spec is not None and len(spec.dims) == len(small.tensors[y].shape):
                    specs[y] = _fitted(spec, small.tensors[y].shape, sizes)
    else:
        log.info("the tail traces to %d ops at %d rows and %d at %d: XLA lays out its slices",
                 len(ops1), R, len(ops2), r)
    return Spread(split=G, graph=small, cut=scut, send=tuple(send), batch=tuple(batch), outside=tuple(outside),
                  pre=tuple(pre), once=once, cot=tuple(scut.tail_cot), specs={(): specs}, draws=draws)


STAGE_ACTIONS = "stage_actions"
"""The name scope of the actions' conds, whose branches the stages take apart (a forward on one stage while
the next idles): a collective in them must be one that only the stage's own devices join (an all-gather or
all-reduce over its axes), never a collective-permute, which on XLA's CPU runtime every device of the
program joins. The compiled program's op names carry the scope, so a test can check that none is there."""


def _fitted(spec: ShardingSpec, shape: Sequence[int], sizes: Mapping[str, int]) -> ShardingSpec:
    """``spec`` on a tensor of ``shape``: each dimension keeps the longest prefix of its mesh axes whose
    product divides it (the tail's layouts on fewer rows)."""
    dims = []
    for axes, n in zip(spec.dims, shape, strict=True):
        keep: list[str] = []
        for a in axes:
            if n % (int(np.prod([sizes[b] for b in keep])) * sizes[a]):
                break
            keep.append(a)
        dims.append(tuple(keep))
    return ShardingSpec(dims=tuple(dims), partial=spec.partial)


def stage_mesh(devices: Sequence[Any], num_stages: int) -> jax.sharding.Mesh:
    """The devices as ``(stage, inner)``: stage ``s`` holds the ``s``-th contiguous block of devices."""
    devs = np.asarray(list(devices), dtype=object)
    if devs.size % num_stages:
        raise cannot_run(f"{devs.size} devices do not split into {num_stages} equal stages")
    return jax.sharding.Mesh(devs.reshape(num_stages, devs.size // num_stages), (STAGE_AXIS, INNER_AXIS))


class SpmdPipelineStep:
    """A step traced at microbatch size (``micro``), run as one SPMD program over ``mesh``
    (``stage_mesh``) with ``num_microbatches`` microbatches in ``schedule_name``'s order. Called with the
    full-size arguments (``full`` is the step traced at that size); returns the step's results."""

    def __init__(self, micro: Graph, full: Graph, mesh: jax.sharding.Mesh, num_microbatches: int,
                 schedule_name: str = "1f1b", specs: Mapping[Scope, Mapping[int, ShardingSpec]] | None = None,
                 num_chunks: int = 1, fused: bool = False, tail: Graph | None = None,
                 program: PipelineProgram | None = None) -> None:
        if schedule_name not in SCHEDULES:
            raise cannot_run(f"the {schedule_name!r} schedule is not supported by the SPMD pipeline yet; use "
                        f"{' or '.join(SCHEDULES)}")
        t0 = time.perf_counter()
        self.graph, self.micro, self.mesh = full, micro, mesh
        self.specs = dict(specs or {})  # the plan's layouts on the stage's own axes, by tensor of ``micro``
        self.inner_axes = tuple(a for a in mesh.axis_names if a != STAGE_AXIS)
        inner = int(np.prod([mesh.shape[a] for a in self.inner_axes]))
        self.predicted: SpmdTime | None = None  # set by ``spmd_pipeline_step`` from the plan's stage times
        S = mesh.shape[STAGE_AXIS]
        chunks = num_chunks if schedule_name == "interleaved-1f1b" else 2 if schedule_name in V_SCHEDULES else 1
        self.num_chunks = chunks
        self.parts = split_step(micro)
        self.num_microbatches = M = num_microbatches
        # draws over the batch's rows, made as jax.jit makes them over the whole batch (``pipeline.draws``),
        # run with their microbatch (never in ``pre``, once a step)
        draws = row_draws(micro, full, M)
        self.draws = draws or frozenset()
        self.cut = uniform_stages(micro, S * chunks, self.parts, top_ops(self.draws))  # a template chunk a virtual stage
        self.batch_pos = self.parts.batch_inputs
        # a spread tail: ``tail`` is the step traced at 1/G of the microbatch's rows (``trace_microbatch`` at
        # ``M·G`` microbatches); its layers after the blocks run on G stages, a slice each (the last G, or in a
        # V, whose last virtual stage is stage 0, the first G: ``Ticks.tail_stages``)
        self.spread = _spread(micro, self.cut, tail, self.batch_pos, self.specs.get((), {}), mesh, full, M) \
            if tail is not None else None
        G = self.spread.split if self.spread is not None else 1
        # every draw is jit's (else each microbatch draws the first one's numbers)
        self.random_exact = draws is not None and (self.spread is None or self.spread.draws is not None)
        if program is None:  # the schedule's program (a plan's own: ``PipelinePlan.program``)
            program = schedule(schedule_name, S, M, chunks, tail_gap=int(G > 1),
                               fused=fused and schedule_name == "1f1b")
        elif (program.num_stages, program.num_microbatches, program.num_virtual_stages, program.tail_gap > 0,
              program.v_shape) != (S, M, S * chunks, G > 1, schedule_name in V_SCHEDULES):
            raise cannot_run(f"the program {program.name!r} runs {program.num_stages} stages x {program.num_chunks} "
                             f"chunk(s) over {program.num_microbatches} microbatches with tail gap {program.tail_gap}; "
                             f"this step has {S} x {chunks} over {M}" + (", its tail spread" if G > 1 else ""))
        self.schedule = program
        self.ticks = ticks(program, G)
        self.v_shape = self.ticks.v_shape  # chunk 1 of stage s runs virtual stage 2S - 1 - s (ZB-V)
        # in a V, one message each way a tick carries a stream or a cotangent where their shapes agree (False:
        # both kinds each way, four ppermutes, as where they differ)
        self.merge_exchanges = True
        self.split = weight_pass(micro, self.cut, self.parts) if self.ticks.weight_pass else None
        self.unreduced_once: dict[str, tuple[dict[int, tuple[str, ...]], dict[int, tuple[str, ...]]]] = {}
        # the chunk's weight gradients, partial sums over the stage's data-parallel axes, left unreduced
        # (stacked) in the loop and reduced once a step after it (``unreduced``)
        grads = self.split.weight[0] if self.split is not None else self.cut.backward
        keep = {self.cut.backward.outputs[p] for p in self.cut.acc_out}
        top = self.specs.get((), {})
        self.unreduced = plan_stacked(micro, [micro.ops[i] for i in grads.ops], top, keep)
        # and the head's and tail's (the embedding's and the LM head's gradients, the loss)
        # (a spread tail's are reduced in each slice's run: its small trace has no plan of its own)
        for name, groups in (("head", (self.cut.head_b,)), ("tail", (self.cut.tail_f, self.cut.tail_b))):
            ops = [micro.ops[i] for grp in groups for i in grp.ops]
            self.unreduced_once[name] = ({}, {}) if name == "tail" and G > 1 else \
                plan_stacked(micro, ops, top, self.cut.accumulated)
        rows = {full.tensors[full.inputs[i]].shape[0] for i in self.batch_pos}
        if len(rows) != 1 or next(iter(rows)) % M:
            raise cannot_run(f"the batch inputs' rows {sorted(rows)} do not split into {M} equal microbatches")
        replicated = NamedSharding(mesh, PartitionSpec())
        by_rows = NamedSharding(mesh, PartitionSpec(self.inner_axes)) if inner > 1 else replicated
        batch = set(self.batch_pos)
        top = self.specs[()] = on_stages(micro, self.cut, dict(self.specs.get((), {})), mesh)

        def laid(i: int, t: int) -> NamedSharding:
            if i in batch:
                return by_rows if full.tensors[t].shape[0] % inner == 0 else replicated
            spec = top.get(micro.inputs[i])  # the plan's layout of a parameter or optimizer leaf
            return named_sharding(mesh, spec) if spec is not None else replicated

        self.in_shardings = tuple(laid(i, t) for i, t in enumerate(full.inputs))
        aliased = sorted(set(full.output_aliases.values()))
        self.donate_argnums = tuple(aliased)
        self._jitted = jax.jit(self._program, in_shardings=self.in_shardings, donate_argnums=self.donate_argnums)
        log.info("SPMD pipeline: %d stages of %d block(s) on %s, %d microbatches, %s, %d ticks%s "
                 "(built in %.2f s)", S, len(self.cut.blocks) // S, dict(mesh.shape), M, schedule_name,
                 self.ticks.num_ticks, f", the tail spread over {G} stages" if G > 1 else "",
                 time.perf_counter() - t0)

    # -- calling ------------------------------------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != self.graph.in_tree:
            raise cannot_run("the arguments' structure differs from the step it was built for")
        return self.call_flat(leaves)

    def call_flat(self, leaves: Sequence[Any]) -> Any:
        outs = self._jitted(*leaves)
        return jax.tree_util.tree_unflatten(self.graph.out_tree, outs)

    def place_state(self, *args: Any) -> tuple[Any, ...]:
        """``args`` laid out as the program reads them, the donated leaves (the train state) as fresh copies:
        the call deletes what it is given there, and the caller's own arrays must outlive it (on CPU even
        ``jax.device_put`` can hand back the caller's buffer as a shard: ``emit.program.copied_leaves``)."""
        leaves, tree = jax.tree_util.tree_flatten(args)
        placed = [x if isinstance(x, jax.Array) and x.sharding == s else jax.device_put(x, s)
                  for x, s in zip(leaves, self.in_shardings, strict=True)]
        return tuple(jax.tree_util.tree_unflatten(tree, copied_leaves(placed, self.donate_argnums,
                                                                      self.in_shardings)))

    def lower(self, *args: Any) -> Any:
        """The program lowered for ``args`` (arrays or ``jax.ShapeDtypeStruct``): its HLO, costs, memory."""
        return self._jitted.lower(*jax.tree_util.tree_leaves(args))

    # -- the program ----------------------------------------------------------------------------------------

    def _program(self, *leaves: Any) -> list[Any]:
        check_leaves(self.graph, leaves, "pipeline")  # when jax.jit traces
        g, cut, M, V = self.micro, self.cut, self.num_microbatches, self.cut.num_stages
        interp = Interpreter(self.mesh, self.specs)
        env: dict[int, Any] = {}
        batch_pos = set(self.batch_pos)
        top = self.specs.get((), {})
        for i, (t, x) in enumerate(zip(g.inputs, leaves, strict=True)):
            if i in batch_pos:  # [rows, ...] -> [M, rows / M, ...]: microbatch m is rows m*r..(m+1)*r
                x = jnp.reshape(x, (M, x.shape[0] // M, *x.shape[1:]))
                spec = top.get(t)
                if spec is not None and self.mesh.size > 1:
                    # each microbatch in the plan's layout, once a step on every device: the argument comes
                    # split by rows over the whole batch, which puts microbatch m on a few devices only
                    x = jax.lax.with_sharding_constraint(x, named_sharding(
                        self.mesh, ShardingSpec(dims=((), *spec.dims), partial=spec.partial)))
            env[t] = x
        batch_t = [g.inputs[i] for i in self.batch_pos]
        pre = interp.run_ops(g, [g.ops[i] for i in cut.pre.ops], cut.pre.inputs,
                             [env[t] for t in cut.pre.inputs], cut.pre.outputs)
        env.update(zip(cut.pre.outputs, pre, strict=True))

        def value(t: int) -> Any:
            if t in env:
                return env[t]
            if t in g.constants:
                return g.constants[t]
            raise cannot_run(f"no value for {g.tensors[t].name!r} outside the loop")

        # what the loop reads from outside: stacked per stage, or whole
        f_stacked = [j for j, k in enumerate(cut.f_kinds) if k == "stacked"]
        b_stacked = [j for j, k in enumerate(cut.b_kinds) if k == "stacked"]
        def per_stage(tids: list[int]) -> Any:  # [S, v, ...]: stage s holds chunks u = c·S + s, c = 0..v-1
            rows = strided_rows(g, tids)  # (in a V chunk 1 of stage s is u = 2S - 1 - s)
            if rows is not None:  # row first + u·step of a layer stack [K, ...]: a reshape, local to each stage
                x, first, step = rows
                x = jax.lax.index_in_dim(env[x].reshape(V, step, *env[x].shape[1:]), first, 1, keepdims=False)
            else:  # a constant of each chunk's own (``stage_constants``) in its traced dtype
                x = jnp.stack([jnp.asarray(value(t), g.tensors[t].dtype) if t in cut.stage_constants else value(t)
                               for t in tids])
            return self._by_stage(x)

        stacked = [per_stage([cut.chunk_f[u].inputs[j] for u in range(V)]) for j in f_stacked]
        stacked += [per_stage([cut.chunk_b[u].inputs[j] for u in range(V)]) for j in b_stacked]
        loop_groups = (cut.head_f, cut.head_b, cut.tail_f, cut.tail_b, cut.side)
        side_made = set(cut.side.outputs) | {t for i in cut.side.ops for t in g.ops[i].outputs}
        whole_ids = sorted({t for grp in loop_groups for t in grp.inputs if t in env or t in g.constants}
                           | {cut.chunk_f[0].inputs[j] for j, k in enumerate(cut.f_kinds) if k == "shared"}
                           | {cut.chunk_b[0].inputs[j] for j, k in enumerate(cut.b_kinds) if k == "shared"})
        whole_ids = [t for t in whole_ids if t not in set(batch_t) and t not in side_made]
        whole = [value(t) for t in whole_ids]
        sp = self.spread
        if sp is not None and sp.pre:  # the values before the loop that the spread tail reads at its shapes
            small_env = {sp.graph.inputs[i]: x for i, x in enumerate(leaves) if i not in batch_pos}
            got = interp.run_ops(sp.graph, [sp.graph.ops[i] for i in sp.cut.pre.ops], sp.cut.pre.inputs,
                                 [small_env[t] for t in sp.cut.pre.inputs], sp.cut.pre.outputs)
            whole += [dict(zip(sp.cut.pre.outputs, got, strict=True))[t] for t in sp.pre]
        batch = [env[t] for t in batch_t]
        tables = {name: jnp.asarray(getattr(self.ticks, name)) for name in
                  ("f_micro", "f_chunk", "b_micro", "b_chunk", "act_read", "act_recv", "cot_read", "cot_recv",
                   "cot_self", "res_write", "res_read")
                  + (("w_micro", "w_chunk", "w_res", "w_cot", "g_write", "g_read") if self.ticks.weight_pass else ())
                  + (("tail_micro", "tail_cot") if self.ticks.spread else ())
                  + (("act_recv_down", "cot_recv_up", "act_turn", "cot_turn") if self.ticks.v_shape else ())}
        if self.ticks.spread:  # whether the stream leaves for the tail's stages at the end of the tick
            tables["tail_send"] = jnp.asarray(np.append(self.ticks.tail_micro[1:], -1))
        stage_spec = PartitionSpec(STAGE_AXIS)
        run = jax.shard_map(
            self._loop, mesh=self.mesh,
            in_specs=([stage_spec] * len(stacked), [PartitionSpec()] * len(whole), [PartitionSpec()] * len(batch),
                      {k: PartitionSpec() for k in tables}),
            out_specs=(stage_spec, PartitionSpec()), axis_names={STAGE_AXIS}, check_vma=False)
        self._whole_ids, self._batch_t, self._f_stacked, self._b_stacked = whole_ids, batch_t, f_stacked, b_stacked
        chunk_acc, once_acc = run(stacked, whole, batch, tables)
        chunk_acc, chunk_state = chunk_acc[:len(cut.acc_out)], chunk_acc[len(cut.acc_out):]
        for k, pos in enumerate(cut.f_state):  # each chunk's own state, as its forward left it
            for u in range(V):
                env[cut.chunk_f[u].outputs[pos]] = chunk_state[k][self.schedule.place(u)]
        held = self.unreduced[0]  # [S, v, D, ...]: the D partial sums of each, added up once a step
        chunk_acc = [a.sum(axis=2) if cut.backward.outputs[p] in held else a
                     for a, p in zip(chunk_acc, cut.acc_out, strict=True)]
        scale = lambda x: (x / jnp.asarray(M, x.dtype)).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) \
            else x  # noqa: E731
        for k, pos in enumerate(cut.acc_out):
            for u in range(V):
                env[cut.chunk_b[u].outputs[pos]] = scale(chunk_acc[k][self.schedule.place(u)])
        for t, x in once_acc.items():
            env[t] = scale(x)
        update = self._stacked_gradients(chunk_acc, env, scale)
        if cut.post.ops:
            got = interp.run_ops(g, [g.ops[i] for i in cut.post.ops], cut.post.inputs,
                                 [value(t) for t in cut.post.inputs], cut.post.outputs)
            env.update(zip(cut.post.outputs, got, strict=True))
        upd = interp.run_ops(g, [g.ops[i] for i in update.ops], update.inputs, [value(t) for t in update.inputs],
                             update.outputs)
        env.update(zip(update.outputs, upd, strict=True))
        outs = [value(t) for t in g.outputs]
        for o, i in g.output_aliases.items():  # a new state leaf leaves as its input came: the next step takes it
            outs[o] = jax.lax.with_sharding_constraint(outs[o], self.in_shardings[i])
        return outs

    def _by_stage(self, x: Any) -> Any:
        """``x`` ``[V, ...]`` by virtual stage as the stages hold it, ``[S, v, ...]``: stage ``s``'s chunk ``c``
        is ``u = c·S + s``, or in a V (``v_shape``) ``2S − 1 − s`` for chunk 1 (chunk 1's rows reversed)."""
        v = self.num_chunks
        x = x.reshape(v, x.shape[0] // v, *x.shape[1:])
        if self.v_shape:
            x = jnp.concatenate([x[:1], jnp.flip(x[1:], axis=1)])
        return jnp.swapaxes(x, 0, 1)

    def _by_virtual(self, a: Any) -> Any:
        """``a`` ``[S, v, ...]`` as the stages hold it, by virtual stage ``[V, ...]`` (``_by_stage``'s inverse)."""
        x = jnp.swapaxes(a, 0, 1)
        if self.v_shape:
            x = jnp.concatenate([x[:1], jnp.flip(x[1:], axis=1)])
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

    def _stacked_gradients(self, chunk_acc: list[Any], env: dict[int, Any], scale: Any) -> Group:
        """The update's ops left to run once a layer stack's gradients are in ``env``: each op that stacks the
        blocks' accumulated gradients in block order (``uniform.stacked_rows``; ``trace.unroll`` makes them)
        becomes a reshape of the accumulators ``[S, v, ...]`` (local to each stage, where stacking the ``K``
        sums one by one would gather them), and is left out with the ops that fed only it."""
        g, cut, V = self.micro, self.cut, self.cut.num_stages
        b0 = cut.chunk_b[0].outputs
        update = set(cut.update.ops)
        skip: set[int] = set()
        for op_id in cut.update.ops:
            rows = stacked_rows(g, op_id)
            if rows is None or len(rows) % V:
                continue
            d = len(rows) // V
            pos = [b0.index(rows[i]) if rows[i] in b0 else -1 for i in range(d)]
            if any(p not in cut.acc_out for p in pos) or any(
                    rows[u * d + i] != cut.chunk_b[u].outputs[p] for u in range(V) for i, p in enumerate(pos)):
                continue
            per_block = [chunk_acc[cut.acc_out.index(p)] for p in pos]  # each [S, v, ...]
            per_block = [self._by_virtual(a) for a in per_block]  # [V, ...]
            x = jnp.stack(per_block, axis=1)
            env[g.ops[op_id].outputs[0]] = scale(x.reshape(V * d, *x.shape[2:]))
            skip.add(op_id)
            skip.update(p for t in g.ops[op_id].inputs if (p := g.tensors[t].producer) is not None
                        and p in update and g.ops[p].primitive != "stack" and g.tensors[t].consumers == (op_id,))
        if not skip:
            return cut.update
        return Group.of(g, [i for i in cut.update.ops if i not in skip])

    def _loop(self, stacked: list[Any], whole: list[Any], batch: list[Any], tables: dict[str, Any]) -> Any:
        g, cut, V = self.micro, self.cut, self.cut.num_stages  # V virtual stages: v chunks on each of S stages
        v = self.num_chunks
        S = V // v
        # inside the shard_map the stage axis is manual: layouts pin on the mesh as seen from here
        abstract = jax.sharding.get_abstract_mesh()
        interp = Interpreter(abstract, self.specs)
        interp.draws = self.draws

        def unreduced(plan: tuple[dict[int, tuple[str, ...]], dict[int, tuple[str, ...]]]) -> Interpreter:
            if not plan[0]:
                return interp
            by = UnreducedInterpreter(abstract, self.specs, *plan, manual={STAGE_AXIS})
            by.draws = self.draws
            return by

        held = self.unreduced[0]
        grads_interp = unreduced(self.unreduced)
        head_interp, tail_interp = unreduced(self.unreduced_once["head"]), unreduced(self.unreduced_once["tail"])
        held_once = {**self.unreduced_once["head"][0], **self.unreduced_once["tail"][0]}
        s = jax.lax.axis_index(STAGE_AXIS)
        nf = len(self._f_stacked)
        f_w = dict(zip(self._f_stacked, [x[0] for x in stacked[:nf]], strict=True))  # [v, ...]: this stage's chunks
        b_w = dict(zip(self._b_stacked, [x[0] for x in stacked[nf:]], strict=True))

        def chunk_of(w: Any, ch: Any) -> Any:
            return jax.lax.dynamic_index_in_dim(w, ch, 0, keepdims=False)

        def virtual(ch: Any) -> Any:  # the virtual stage of this stage's chunk ``ch``: the head's at 0, the tail's at V-1
            return jnp.where(ch == 1, 2 * S - 1 - s, ch * S + s) if self.v_shape else ch * S + s
        n_whole = len(self._whole_ids)
        outer = dict(zip(self._whole_ids, whole[:n_whole], strict=True))
        small_pre = dict(zip(self.spread.pre, whole[n_whole:], strict=True)) if self.spread is not None else {}
        f0, b0 = cut.chunk_f[0], cut.backward

        def aval(t: int) -> jax.ShapeDtypeStruct:
            ten = g.tensors[t]
            return jax.ShapeDtypeStruct(ten.shape, jnp.dtype(ten.dtype))

        acts = [aval(t) for t in cut.head_act]
        cots = [aval(b0.outputs[k]) for k in cut.cot_out]
        res = [aval(t) for t in cut.residuals]
        head_res = [aval(t) for t in cut.head_res]
        accs = [aval(b0.outputs[k]) for k in cut.acc_out]
        accs = [jax.ShapeDtypeStruct((stacked_size(self.mesh, held[t]), *a.shape), a.dtype) if (t := b0.outputs[k])
                in held else a for a, k in zip(accs, cut.acc_out, strict=True)]
        once_ids = [t for grp in (cut.head_f, cut.head_b, cut.tail_f, cut.tail_b) for t in grp.outputs
                    if t in cut.accumulated]
        T = self.ticks

        def zeros(a: jax.ShapeDtypeStruct, lead: int | None = None) -> Any:
            return jnp.zeros(((lead,) if lead is not None else ()) + a.shape, a.dtype)

        wp = self.split
        carry0 = dict(
            act=[zeros(a, T.act_slots) for a in acts], cot=[zeros(a, T.cot_slots) for a in cots],
            res=[zeros(a, T.res_slots) for a in res], hres=[zeros(a, T.res_slots) for a in head_res],
            acc=[zeros(a, v) for a in accs], fst=[zeros(aval(f0.outputs[k]), v) for k in cut.f_state],
            once={t: zeros(aval(t), stacked_size(self.mesh, held_once[t]) if t in held_once else None)
                  for t in once_ids},
            g=[] if wp is None else [zeros(aval(wp.input_b[0].outputs[k]), T.g_slots) for k in wp.g_out])
        sp = self.spread
        if sp is not None:  # the stream to spread (on the last stage), its slice here, the slice's cotangents
            small = lambda t: jax.ShapeDtypeStruct(sp.graph.tensors[t].shape,  # noqa: E731
                                                   jnp.dtype(sp.graph.tensors[t].dtype))
            carry0.update(tsend=[zeros(aval(t1)) for t1, _ in sp.send], tin=[zeros(small(t2)) for _, t2 in sp.send],
                          tout=[zeros(small(t2)) for t2 in sp.cot])

        def micro_batch(m: Any) -> dict[int, Any]:
            """Microbatch ``m``'s batch values and side inputs, in the plan's layouts. Made at the tick's top
            level, on every stage, never inside an action's ``lax.cond``: the stages take their conds'
            branches apart, so a collective in a branch must be one that only the stage's own devices join.
            Moving a batch value into the plan's layout can be a collective-permute (its rows in another
            device order), which on XLA's CPU runtime every device of the program joins: inside a branch
            that only stage 0 takes (the head), the other stages never arrive and the step hangs."""
            e = dict(outer)
            for t, x in zip(self._batch_t, batch, strict=True):
                e[t] = interp.pin(jax.lax.dynamic_index_in_dim(x, jnp.maximum(m, 0), 0, keepdims=False), t)
            e[BLOCK] = m
            if cut.side.ops:  # side inputs (a padding mask): every stage makes them from its microbatch
                run(cut.side, e)
            return {t: e[t] for t in (*self._batch_t, *cut.side.outputs, BLOCK)}

        def micro_env(mb: dict[int, Any]) -> dict[int, Any]:
            return {**outer, **mb}

        def run(group: Any, e: dict[int, Any], by: Interpreter | None = None) -> None:
            by = by or interp
            by.block = e.get(BLOCK)  # the microbatch's index: its draws over the rows (``pipeline.draws``)
            outs = by.run_ops(g, [g.ops[i] for i in group.ops], group.inputs, [e[t] for t in group.inputs],
                              group.outputs)
            e.update(zip(group.outputs, outs, strict=True))

        def add_once(c: dict, e: dict[int, Any], group: Any) -> None:
            for t in group.outputs:
                if t in c["once"]:
                    c["once"][t] = c["once"][t] + e[t].astype(c["once"][t].dtype)

        def put(buf: Any, k: Any, x: Any) -> Any:
            return jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), jnp.maximum(k, 0), 0)

        def get(buf: Any, k: Any) -> Any:
            return jax.lax.dynamic_index_in_dim(buf, jnp.maximum(k, 0), 0, keepdims=False)

        def forward(c: dict, t: Any, mb: dict[int, Any]) -> tuple[dict, list[Any]]:
            ch = tables["f_chunk"][t, s]
            u = virtual(ch)
            e = micro_env(mb)

            def from_head(c: dict) -> tuple[list[Any], list[Any]]:
                run(cut.head_f, e)
                return [e[x] for x in cut.head_act], [e[x] for x in cut.head_res]

            def from_buffer(c: dict) -> tuple[list[Any], list[Any]]:
                k = tables["act_read"][t, s]
                return [get(b, k) for b in c["act"]], [zeros(a) for a in head_res]

            stream, hres = jax.lax.cond(u == 0, from_head, from_buffer, c)
            fe = dict(e)
            for j, tid in enumerate(f0.inputs):
                kind = cut.f_kinds[j]
                if kind.startswith("act:"):
                    fe[tid] = stream[int(kind[4:])]
                elif kind == "stacked":
                    fe[tid] = chunk_of(f_w[j], ch)
            run(f0, fe)
            # the chunk's own state (``cut.f_state``), the same for every microbatch: the last one's kept
            c = dict(c, fst=[put(b, ch, fe[f0.outputs[k]]) for b, k in zip(c["fst"], cut.f_state, strict=True)])
            slot = tables["res_write"][t, s]
            c = dict(c, res=[put(b, slot, fe[x]) for b, x in zip(c["res"], cut.residuals, strict=True)],
                     hres=[put(b, slot, x) for b, x in zip(c["hres"], hres, strict=True)])
            out = [fe[f0.outputs[k]] for k in cut.act_out]

            def tail(c: dict) -> dict:
                te = dict(e)
                last = cut.chunk_f[V - 1]
                for k, x in enumerate(f0.outputs):
                    te[last.outputs[k]] = fe[x]
                for j, x in enumerate(f0.inputs):
                    if cut.f_kinds[j].startswith("act:"):
                        te[last.inputs[j]] = fe[x]
                if sp is not None:  # the tail runs next tick on the G tail stages: keep what it reads
                    return dict(c, tsend=[te[t1] for t1, _ in sp.send])
                run(cut.tail_f, te, tail_interp)
                run(cut.tail_b, te, tail_interp)
                once = dict(c["once"])
                c = dict(c, once=once)
                add_once(c, te, cut.tail_f)
                add_once(c, te, cut.tail_b)
                k = tables["cot_self"][t, s]
                return dict(c, cot=[put(b, k, te[x]) for b, x in zip(c["cot"], cut.tail_cot, strict=True)])

            c = jax.lax.cond(u == V - 1, tail, lambda c: c, c)
            return c, out

        def backward_input(c: dict, j: int, slot: Any, k: Any, ch: Any) -> Any:
            """The chunk backward's input ``j`` (``cut.b_kinds``): a residual from slot ``slot``, the
            cotangent from slot ``k``, the chunk's weight; None for what the environment holds."""
            kind = cut.b_kinds[j]
            if kind.startswith("res:"):
                return get(c["res"][int(kind[4:])], slot)
            if kind.startswith("cot:"):
                return get(c["cot"][int(kind[4:])], k)
            if kind == "stacked":
                return chunk_of(b_w[j], ch)
            return None

        def accumulate(c: dict, ch: Any, env: dict[int, Any], which: Any) -> dict:
            return dict(c, acc=[put(a, ch, get(a, ch) + env[b0.outputs[p]].astype(a.dtype)) if which(p) else a
                                for a, p in zip(c["acc"], cut.acc_out, strict=True)])

        def backward(c: dict, t: Any, mb: dict[int, Any]) -> tuple[dict, list[Any]]:
            ch = tables["b_chunk"][t, s]
            u = virtual(ch)
            e = micro_env(mb)
            slot = tables["res_read"][t, s]
            k = tables["cot_read"][t, s]
            be = dict(e)
            if wp is None:  # the whole backward
                for j, tid in enumerate(b0.inputs):
                    x = backward_input(c, j, slot, k, ch)
                    if x is not None:
                        be[tid] = x
                run(b0, be, grads_interp)
                c = accumulate(c, ch, be, lambda p: True)
            else:  # its input-gradient part; what the weight-gradient part reads of it is kept for W
                ib0 = wp.input_b[0]
                for tid, j in zip(ib0.inputs, wp.b_from, strict=True):
                    x = backward_input(c, j, slot, k, ch)
                    if x is not None:
                        be[tid] = x
                run(ib0, be)
                kg = tables["g_write"][t, s]
                c = dict(c, g=[put(b, kg, be[ib0.outputs[q]]) for b, q in zip(c["g"], wp.g_out, strict=True)])
                c = accumulate(c, ch, be, lambda p: p in wp.acc_in_b)
            out = [be[b0.outputs[p]] for p in cut.cot_out]

            def head(c: dict) -> dict:
                he = dict(e)
                for x, v in zip(cut.head_res, c["hres"], strict=True):
                    he[x] = get(v, slot)
                for p, x in zip(cut.cot_out, out, strict=True):  # chunk 0's cotangents by their own ids
                    he[b0.outputs[p]] = x
                run(cut.head_b, he, head_interp)
                c = dict(c, once=dict(c["once"]))
                add_once(c, he, cut.head_b)
                return c

            c = jax.lax.cond(u == 0, head, lambda c: c, c)
            return c, out

        def weight(c: dict, t: Any, mb: dict[int, Any]) -> dict:
            assert wp is not None
            ch = tables["w_chunk"][t, s]
            we = micro_env(mb)
            w0 = wp.weight[0]
            for tid, (src, j) in zip(w0.inputs, wp.w_from, strict=True):
                if src == "g":
                    we[tid] = get(c["g"][j], tables["g_read"][t, s])
                else:
                    x = backward_input(c, j, tables["w_res"][t, s], tables["w_cot"][t, s], ch)
                    if x is not None:
                        we[tid] = x
            run(w0, we, grads_interp)
            return accumulate(c, ch, we, lambda p: p not in wp.acc_in_b)

        def no_forward(c: dict, t: Any, mb: dict[int, Any]) -> tuple[dict, list[Any]]:
            return c, [zeros(a) for a in acts]

        def no_backward(c: dict, t: Any, mb: dict[int, Any]) -> tuple[dict, list[Any]]:
            return c, [zeros(a) for a in cots]

        # round the ring: with chunks, stage S-1's chunk c hands over to stage 0's chunk c+1 (and back)
        up = [(i, (i + 1) % S) for i in range(S)] if v > 1 else [(i, i + 1) for i in range(S - 1)]
        down = [((i + 1) % S, i) for i in range(S)] if v > 1 else [(i + 1, i) for i in range(S - 1)]

        if sp is not None:
            G = sp.split
            # the stage of the last virtual stage, whose stream is spread, and the first of the G that run slices
            home, first = self.schedule.place(V - 1)[0], T.tail_stages().start
            small_interp = Interpreter(abstract, sp.specs)
            small_interp.draws = sp.draws or frozenset()
            inexact = lambda x: jnp.issubdtype(x.dtype, jnp.inexact)  # noqa: E731
            over_g = lambda x: (x / jnp.asarray(G, x.dtype)).astype(x.dtype) if inexact(x) else x  # noqa: E731

            def tail_slice(c: dict, t: Any) -> dict:
                """On the G tail stages: the tail (forward and backward) of slice ``s − first`` of the
                microbatch's rows; its sums count 1/G of the microbatch's (the step is a mean over rows)."""
                m, gi = tables["tail_micro"][t], s - first
                se: dict[int, Any] = {t2: outer[t1] for t1, t2 in sp.outside} | small_pre
                for t1, t2 in sp.batch:
                    x = jax.lax.dynamic_index_in_dim(batch[self._batch_t.index(t1)], m, 0, keepdims=False)
                    r = sp.graph.tensors[t2].shape[0]
                    se[t2] = jax.lax.dynamic_slice_in_dim(x, gi * r, r, 0)
                for (_, t2), x in zip(sp.send, c["tin"], strict=True):
                    se[t2] = x
                small_interp.block = m * G + gi  # the slice's rows are block m·G + gi of the batch's
                for grp in (sp.cut.tail_f, sp.cut.tail_b):
                    outs = small_interp.run_ops(sp.graph, [sp.graph.ops[i] for i in grp.ops], grp.inputs,
                                                [se[x] for x in grp.inputs], grp.outputs)
                    se.update(zip(grp.outputs, outs, strict=True))
                once = dict(c["once"])
                for t1, t2 in sp.once:
                    once[t1] = once[t1] + over_g(se[t2]).astype(once[t1].dtype)
                return dict(c, once=once, tout=[over_g(se[t2]) for t2 in sp.cot])

            def send_tail(c: dict) -> dict:
                """The stream's row slices from the last virtual stage's stage to the G tail stages (slice g to
                stage ``first + g``)."""
                tin = []
                for x in c["tsend"]:
                    r = x.shape[0] // G
                    got = jnp.zeros((r, *x.shape[1:]), x.dtype)
                    for gi in range(G):
                        piece = jax.lax.slice_in_dim(x, gi * r, (gi + 1) * r, axis=0)
                        dst = first + gi
                        got = got + (jnp.where(s == home, piece, 0) if dst == home
                                     else jax.lax.ppermute(piece, STAGE_AXIS, [(home, dst)]))
                    tin.append(got)
                return dict(c, tin=tin)

            def return_tail(c: dict, t: Any) -> dict:
                """The slices' cotangents back to the last virtual stage's stage, joined in row order, into its
                slot."""
                k = tables["tail_cot"][t]
                cot = list(c["cot"])
                for ch, x in enumerate(c["tout"]):
                    pieces = [x if first + gi == home else jax.lax.ppermute(x, STAGE_AXIS, [(first + gi, home)])
                              for gi in range(G)]
                    whole_cot = jnp.concatenate(pieces, axis=0)
                    cot[ch] = jnp.where(s == home, put(cot[ch], k, whole_cot), cot[ch])
                return dict(c, cot=cot)

        # in a V each stage hears from both sides: one message each way, a stream or a cotangent (``ticks``
        # checks a stage sends at most one value each way a tick), or both kinds each way where their shapes
        # differ; the turn's values stay on stage S - 1
        one_way = self.merge_exchanges and [(a.shape, a.dtype) for a in acts] == [(a.shape, a.dtype) for a in cots]

        def keep(buf: Any, k: Any, x: Any) -> Any:  # ``x`` into slot ``k`` if ``k >= 0``, one slot's select
            return put(buf, k, jnp.where(k >= 0, x.astype(buf.dtype), get(buf, k)))

        def exchange_v(c: dict, t: Any, send_act: list[Any], send_cot: list[Any]) -> dict:
            f_on, ch_f = tables["f_micro"][t, s] >= 0, tables["f_chunk"][t, s]
            ring_up, ring_down = [(i, i + 1) for i in range(S - 1)], [(i + 1, i) for i in range(S - 1)]
            if one_way:  # chunk 0's stream and chunk 1's cotangent go up, chunk 1's stream and chunk 0's down
                msg_up = [jnp.where(f_on & (ch_f == 0), a, x) for a, x in zip(send_act, send_cot, strict=True)]
                msg_down = [jnp.where(f_on & (ch_f == 1), a, x) for a, x in zip(send_act, send_cot, strict=True)]
                act_up = cot_up = [jax.lax.ppermute(x, STAGE_AXIS, ring_up) for x in msg_up]
                act_down = cot_down = [jax.lax.ppermute(x, STAGE_AXIS, ring_down) for x in msg_down]
            else:
                act_up, act_down = ([jax.lax.ppermute(x, STAGE_AXIS, p) for x in send_act] for p in (ring_up, ring_down))
                cot_up, cot_down = ([jax.lax.ppermute(x, STAGE_AXIS, p) for x in send_cot] for p in (ring_up, ring_down))
            act, cot = list(c["act"]), list(c["cot"])
            for name, got in (("act_recv", act_up), ("act_recv_down", act_down), ("act_turn", send_act)):
                act = [keep(b, tables[name][t, s], x) for b, x in zip(act, got, strict=True)]
            for name, got in (("cot_recv", cot_down), ("cot_recv_up", cot_up), ("cot_turn", send_cot)):
                cot = [keep(b, tables[name][t, s], x) for b, x in zip(cot, got, strict=True)]
            return dict(c, act=act, cot=cot)

        def tick(c: dict, t: Any) -> tuple[dict, None]:
            if sp is not None:  # first the tail of the microbatch whose stream arrived last tick
                c = jax.lax.cond((tables["tail_micro"][t] >= 0) & (s >= first) & (s < first + G), tail_slice,
                                 lambda c, t: c, c, t)
            # a forward, then a backward (fused 1F1B runs both in one tick; other schedules one of them)
            fm, bm = tables["f_micro"][t, s], tables["b_micro"][t, s]
            f_mb, b_mb = micro_batch(fm), micro_batch(bm)
            w_mb = micro_batch(wm := tables["w_micro"][t, s]) if wp is not None else {}
            with jax.named_scope(STAGE_ACTIONS):  # the conds each stage takes apart (``STAGE_ACTIONS``)
                c, send_act = jax.lax.cond(fm >= 0, forward, no_forward, c, t, f_mb)
                c, send_cot = jax.lax.cond(bm >= 0, backward, no_backward, c, t, b_mb)
                if wp is not None:  # then the weight-gradient part of an earlier backward
                    c = jax.lax.cond(wm >= 0, weight, lambda c, t, mb: c, c, t, w_mb)
            if self.v_shape:
                c = exchange_v(c, t, send_act, send_cot)
            else:
                got_act = [jax.lax.ppermute(x, STAGE_AXIS, up) for x in send_act]
                got_cot = [jax.lax.ppermute(x, STAGE_AXIS, down) for x in send_cot]
                ka, kc = tables["act_recv"][t, s], tables["cot_recv"][t, s]
                act = [jnp.where(ka >= 0, put(b, ka, x), b) for b, x in zip(c["act"], got_act, strict=True)]
                cot = [jnp.where(kc >= 0, put(b, kc, x), b) for b, x in zip(c["cot"], got_cot, strict=True)]
                c = dict(c, act=act, cot=cot)
            if sp is not None:  # the spread tail's exchanges, on every stage or none (the tables are per tick)
                c = jax.lax.cond(tables["tail_micro"][t] >= 0, return_tail, lambda c, t: c, c, t)
                c = jax.lax.cond(tables["tail_send"][t] >= 0, send_tail, lambda c: c, c)
            return c, None

        c, _ = jax.lax.scan(tick, carry0, jnp.arange(T.num_ticks))
        chunk_acc = [a[None] for a in c["acc"]] + [a[None] for a in c["fst"]]
        once = {t: jax.lax.psum(x.sum(axis=0) if t in held_once else x, STAGE_AXIS) for t, x in c["once"].items()}
        return chunk_acc, once


def spmd_pipeline_step(micro: Graph, full: Graph, plan: PipelinePlan, devices: Sequence[Any],
                       tail: Graph | None = None) -> SpmdPipelineStep:
    """``plan`` (a pipelined plan of ``micro``, the step traced at microbatch size; ``full`` at full size)
    as one SPMD program on ``devices`` (row-major over the plan's cluster): its physical stages' devices
    become the rows of the stage axis. A plan whose tail is spread over stages (``plan.tail_split``) needs
    ``tail``: the step traced at that fraction of the microbatch (``tail_graph``)."""
    if plan.tail_split > 1 and tail is None:
        raise cannot_run(f"the plan spreads the tail over {plan.tail_split} stages: pass tail=, the step traced at "
                         f"{plan.num_microbatches * plan.tail_split} microbatches (pipeline.spmd_program.tail_graph)")
    S = plan.num_physical_stages
    cluster = plan.cluster
    rows = [[devices[i] for i in st.devices(cluster)] for st in plan.stages[:S]]
    if len({len(r) for r in rows}) != 1:
        raise cannot_run(f"its stages have submeshes of {sorted({len(r) for r in rows})} devices; the SPMD pipeline "
                    "needs the same submesh for every stage (stage_shape=(hosts, devices) fixes it)")
    name = plan.schedule
    if name not in SCHEDULES:
        raise cannot_run(f"the plan's {name!r} schedule is not one the SPMD pipeline runs ({', '.join(SCHEDULES)})")
    # the stage's own axes (its plan's logical mesh) beside the stage axis: the plan's layouts pin onto them
    stage = plan.stages[0].mesh
    if STAGE_AXIS in stage.axis_names:
        raise cannot_run(f"the stages' mesh already has an axis named {STAGE_AXIS!r}")
    mesh = jax.sharding.Mesh(np.asarray(rows, dtype=object).reshape(S, *stage.shape), (STAGE_AXIS, *stage.axis_names))
    specs: dict[Scope, dict[int, ShardingSpec]] = {}
    for st in plan.stages:
        for table in (st.specs, st.update_specs):
            for key, by_tensor in table.items():
                specs.setdefault(normalize_key(key), {}).update(by_tensor)
    step = SpmdPipelineStep(micro, full, mesh, plan.num_microbatches, name, specs, plan.num_chunks,
                            fused=plan.fused_ticks, tail=tail if plan.tail_split > 1 else None, program=plan.program)
    got = step.spread.split if step.spread is not None else 1
    if got != plan.tail_split:
        raise cannot_run(f"the plan spreads the tail over {plan.tail_split} stages; the step given as tail= splits "
                         f"it over {got}")
    step.predicted = _priced(plan, step)
    if step.predicted is not None:
        log.info("the SPMD program: %.4g s a step predicted (%d ticks in lockstep, %.3g s of them "
                 "exchanging; the plan's %s schedule priced %.4g s)", step.predicted.step, step.predicted.ticks,
                 step.predicted.exchange, plan.schedule, plan.predicted_step_time)
    return step


def _priced(plan: PipelinePlan, step: SpmdPipelineStep) -> SpmdTime | None:
    """``price`` of ``step`` with the stage times of ``plan``, on the links of the plan's hardware (None
    when the hardware cannot be loaded here: a profile file saved elsewhere)."""
    from cost_models import CostModel
    from cost_models.errors import CostModelError

    try:
        cost = CostModel.load(plan.hardware, mesh=plan.mesh)
    except (CostModelError, OSError, ValueError):
        return None
    S = plan.num_physical_stages
    hosts = {st.origin[0] for st in plan.stages[:S]}
    link = cost.cluster.inter_link if len(hosts) > 1 else cost.cluster.intra_link
    stream = sum(step.micro.tensors[t].nbytes for t in step.cut.head_act)
    dispatch = getattr(cost.profile, "overhead", 0.0) or DISPATCH_S
    per_stage_update = [sum(plan.stages[u].update_time for u in range(len(plan.stages))  # its chunks
                            if step.schedule.place(u)[0] == s) for s in range(S)]
    times = [st.micro_time for st in plan.stages]
    if plan.tail_split > 1:  # the tail's seconds leave the last stage for the G stages' tail ticks
        times[-1] = max(times[-1] - plan.tail_time, 0.0)
    return price(times, per_stage_update, step.ticks, stream_bytes=stream, link=link, inner=step.mesh.size // S,
                 dispatch=dispatch, tail=plan.tail_time)


def tail_graph(fn: Any, args: Sequence[Any], full: Graph, plan: PipelinePlan, *,
               roles: Mapping[str | int, Any] | None = None) -> Graph | None:
    """The step traced at ``1 / plan.tail_split`` of the microbatch (what a spread tail runs), with the plan's
    recompute, or None when the plan keeps the tail on the last stage."""
    if plan.tail_split <= 1:
        return None
    from autoshard.pipeline.partition import trace_microbatch
    from autoshard.planner.recompute import recomputed

    small = trace_microbatch(fn, args, full, plan.num_microbatches * plan.tail_split, roles=roles)
    return recomputed(small, plan.recompute)  # its blocks as the plan's trace has them

"""Plan a pipelined step: layers, stage costs from the intra-op planner, the stage DP, per-stage plans.

Inputs: the step traced at microbatch size, the cluster's cost model (a 1-D mesh ``(n,)`` is one host of
``n`` devices; a 2-D mesh ``(H, D)`` is ``H`` hosts of ``D``), ``B`` microbatches and a schedule.

1. ``partition.split_step`` and ``assign_layers`` give every op a layer ``ℓ ∈ [0, L)``.
2. For every layer ``ℓ`` and Alpa submesh shape ``m`` (``(1, 2^k)`` and ``(h, D)``), the intra-op planner
   plans the layer's microbatched ops and, separately, its update ops on a mesh of that shape
   (``layer_prices.plan_part``). Gradients are accumulated unreduced over the ``B`` microbatches and
   reduced once per step (``pipeline.unreduced``): the microbatch plan is solved with the reduction of
   its pending-sum results weighted ``1/B`` (the trade-off it really faces), and the reduction's price
   ``R(ℓ, m)`` is split off the microbatch time and paid once per step beside the update ``U(ℓ, m)``.
   Layers with the same op signature (a stack of identical blocks) are planned once per shape. The stage
   tables of ``solvers.inter_op`` are then sums over layers (and a maximum):

       t[i, j, m] = Σ_{ℓ=i..j} T_micro(ℓ, m) + 2·X(i) / (n_m·β)      (forward activations in, cotangents out)
       u[i, j, m] = Σ_{ℓ=i..j} (R(ℓ, m) + U(ℓ, m))                   (once per step: reduce, then update)
       σ[i, j, m] = Σ_{ℓ=i..j} M_update(ℓ, m) + max_{ℓ=i..j} τ(ℓ, m)  (parameters, gradients, optimizer state;
                                                                       the largest pass's temporaries)
       α[i, j, m] = Σ_{ℓ=i..j} M_micro(ℓ, m)                         (one microbatch in flight)

   with ``M_micro`` a layer's held activations and ``τ`` what its pass needs besides, one layer at a time
   (``layer_prices.held_and_transient``);

   where ``X(i)`` is the bytes live across the cut before layer ``i``, ``β`` the bandwidth of the
   mesh's slowest link and ``n_m`` the devices of shape ``m``: every device sends and receives its own
   shard on its own link (a DGX node has one InfiniBand NIC per GPU; Megatron's scatter-gather sends
   ``1/t`` of a replicated activation per GPU), so ``n_m`` links carry the cut at once. Each layer is planned under its share of a
   stage's memory (``budget · N / (n_m · L)``: on shape ``m`` about ``N / n_m`` stages of ``L·n_m / N``
   layers) with its activations counted ``inflight`` times (the first stage's), so that it picks layouts
   a whole stage can hold; a layer that cannot fit its share is priced under the whole budget. Summing
   per-layer plans ignores resharding between layers inside a stage; the chosen stages are re-planned
   whole in step 4, and those plans give the reported times. Identical stages are planned once.
3. The step time of stages ``s`` is ``T = Σ_s t_s + (B − 1)·max_s t_s + max_s u_s`` (the once-per-step
   work of every stage runs after its last backward, in parallel across stages). ``solvers.solve_inter_op``
   minimises ``Σ_s t'_s + (B − 1)·max_s t'_s`` with ``t' = t + u / B`` under ``σ + inflight(r)·α <=
   budget``: when one stage has both the largest ``t`` and the largest ``u`` (balanced stages) its
   objective is ``T + (Σ_s u_s − max_s u_s) / B``, so it never drops the update and never charges a
   gradient reduction more than once per step (before, ``R`` sat inside ``t``: ``B`` times). The DP's
   memory adds its layers' memory; each chosen stage is then checked whole: its layers' plans joined
   (``layer_prices.assignment_of_layers``) in the stage's own problem with its microbatches in flight.
   A stage they overflow is struck from the tables (``t[i, j, m] = ∞``) and the DP runs again, at most
   ``MAX_RECUTS`` times (GPT-39B, 128 microbatches: six blocks on 2x4 with 8 in flight fit by the sum
   and not whole, and the whole-stage solve, started from nothing that fits, planned 219 ms for 72).
4. Each chosen stage is planned whole (update ops, then microbatched ops) on its submesh, with the same
   ``1/B`` weighting, its solve started from the layouts its layers' plans give its inputs
   (``layer_prices.layouts_of_layers``): a stage's ILP is ``L/S`` times a layer's and gets less time
   per node, and alone it can end far above the sum the DP saw (GPT-39B on 8x8: 810 ms planned whole
   against 206 ms summed); started there it is the layers' layouts plus the resharding between them. The predicted step time is
   these plans' ``t_s`` and ``u_s`` priced by ``solvers.pipeline.simulate`` (the schedule's own timeline, the
   MPMD runtime's host beside it), which ``T`` above bounds from above and equals on equal stages.

**Recompute per stage** (``modes``: ``pipeline.recompute`` offers the modes cheaper than the one being
planned). Under 1F1B stage ``s`` of ``S`` holds ``S − s`` microbatches in flight, so the memory that forces
recompute binds on the first stages only. Each recompute mode ``r`` (the microbatch step rewritten with
every block in ``r``, cut into the same layers) gets its own tables ``t^r, u^r, σ^r, α^r``, and the DP's
options are the pairs ``(m, r)``: a stage ``(i..j, (m, r))`` is allowed with ``k`` stages after it when
``σ^r[i, j, m] + inflight[k]·α^r[i, j, m] <= budget``, the recurrence and objective unchanged. The chosen
stages give each block its stage's mode (a block cut across two stages, the more recomputing one: its
memory is then at most what the DP counted); the step is rewritten so and its stages planned whole as in
step 4. A layer whose copies were planned once for the most microbatches in flight, and do not fit so, is
planned again for its own place's count (``layer_prices.price_layers``), so that a cheaper mode has a price
where fewer are in flight. The SPMD program (``uniform``) keeps one mode on every stage: its lockstep
ticks last as long as the slowest stage's work, so a cheaper mode on the last stages buys nothing there.

Interleaved 1F1B (``v`` model chunks per stage, Narayanan et al. 2021 §2.2) runs on a given stage layout
(``stage_shape``: ``S`` equal submeshes): step 3 becomes a linear-partition DP cutting the layers into
``V = v·S`` contiguous virtual stages minimising the slowest ``t'``, virtual stage ``u`` on submesh
``u mod S``; each virtual stage is planned whole as in step 4, its activations counted as many times as
the schedule keeps its own chunk's microbatches in flight (``Schedule.peak_inflight_by_chunk``), under its
share of the physical stage's budget (``_chunk_budgets``), and the step time is the schedule's simulated
makespan (backward = 2 × forward) plus the largest per-stage sum of its chunks' once-per-step times. For the
SPMD program (``uniform``) the cut is the program's own instead, ``K / V`` of the ``K`` blocks a virtual
stage, priced as its lockstep ticks run, the tail spread over the last stages where that is faster
(``_uniform``, as for one chunk a stage): a min-max cut can give a heavy tail a virtual stage of its own
and two blocks to another, which the program does not run.

The schedule as a planner decision (``schedule_name="auto"``, the default of ``autoshard.plan``): the
stages are cut and planned for 1F1B, then 1F1B and ZB-H1 are both priced on them (``_pipeline_time``) and
the faster is the plan's schedule. ZB-H1 keeps the microbatches in flight 1F1B keeps (``schedules``), so
the stages' plans and memory hold for both; its weight-gradient passes fill 1F1B's warm-up and cool-down
idle slots (Qi et al. 2024), which pays where the bubble is large: GPT-1T's 128 stages of 3x8 over 1024
microbatches, 119.30 s of pipeline under 1F1B (then Alpa's closed form, an upper bound of the simulated
timeline both are priced by now), 115.47 s under ZB-H1 (``solvers.pipeline.simulate``).

For the SPMD program (``uniform``) the schedule left to the planner also prices ZB-V (two chunks a stage
in a V, with ZB-H1's weight pass; ``schedules.zb_v``) on the same layer prices: the cut into ``2S`` virtual
stages of ``K / 2S`` blocks (chunk 1 of stage ``s`` being virtual stage ``2S − 1 − s``, ``place``), its
lockstep ticks (``simulate``), its memory its chunks' own microbatches in flight; it wins where its ticks are
shorter (each a forward of half a stage, the bubble filled with ``W``). Its tail stays on stage 0 (no
spread), and the MPMD runtime does not run it.

Known limits: a ``scan`` over layers is one forward op, so a scanned stack is one layer (trace with the
layers unrolled to pipeline them).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from autoshard.pipeline.draws import row_shaped
from autoshard.pipeline.host import HostCosts, HostWork, host_work
from autoshard.pipeline.layer_prices import (
    LayerPrices,
    Part,
    assignment_of_layers,
    layouts_of_layers,
    plan_part,
    price_layers,
    remap,
    reuse,
    signature,
    submesh_cost,
)
from autoshard.pipeline.partition import (
    FORWARD,
    UPDATE,
    PipelineDoesNotFit,
    PipelineError,
    assign_layers,
    batch_rows,
    forward_sequence,
    split_step,
    subgraph,
)
from autoshard.pipeline.pipeline_plan import PipelinePlan, PipelineReport, StagePlan, cluster_of, graph_digest
from autoshard.pipeline.ticks import (
    fused_inflight,
    lockstep_costs,
    lockstep_tables,
    price,
    spread_times,
)
from autoshard.pipeline.uniform import tail_spreadable, uniform_stages
from autoshard.planner.deadline import Deadline
from autoshard.planner.plan import input_signature
from autoshard.planner.planning import PROBLEMS, ProblemCache
from autoshard.planner.readback import peak_memory_of
from autoshard.planner.recompute import describe
from autoshard.planner.seeds import assignment_choice
from autoshard.planner.shares import SHARES
from autoshard.planner.summary import human_time
from autoshard.trace.graph import Graph
from autoshard.trace.remat import REMAT_MODES, summary
from cost_models import CostModel
from solvers.inter_op import (
    InterOpInfeasibleError,
    InterOpProblem,
    PartitionInfeasibleError,
    alpa_submeshes,
    linear_partition,
    solve_inter_op,
)
from solvers.pipeline.program import place
from solvers.pipeline.schedules import (
    SCHEDULE_NAMES,
    V_SCHEDULES,
    WEIGHT_PASS_SCHEDULES,
    chunk_inflight_rule,
    inflight_rule,
    schedule,
)
from solvers.pipeline.simulate import Costs, Timing, simulate

if TYPE_CHECKING:  # a later pass: it hands its modes in
    from autoshard.pipeline.recompute import StageModes

log = logging.getLogger("autoshard")


def plan_pipeline(graph: Graph, cost: CostModel, *, hardware: str = "", memory_budget: float | None = None,
                  num_microbatches: int = 4, schedule_name: str = "1f1b", num_layers: int | None = None,
                  time_budget_s: float | None = None, max_stages: int | None = None,
                  forced_boundaries: Sequence[int] = (), stage_shape: tuple[int, int] | None = None,
                  num_chunks: int = 2, uniform: bool = False, spread_tail: bool = True,
                  modes: StageModes | None = None, deadline: Deadline | None = None) -> PipelinePlan:
    """Plan ``graph`` (the step traced at microbatch size) as a pipeline on ``cost.mesh``; see the module
    docstring. ``num_layers`` defaults to one per block the scopes name, plus one
    (``partition.default_num_layers``); ``max_stages`` bounds the stage count; ``stage_shape`` =
    (hosts, devices) makes every stage that submesh (so ``devices / size`` stages). The interleaved
    schedule needs ``stage_shape`` and holds ``num_chunks`` model chunks per stage (``_interleaved``);
    ``schedule_name="auto"`` prices ``AUTO_SCHEDULES`` on the stages and keeps the faster (module docstring).
    ``time_budget_s``: solver seconds for the whole pipeline (None: scaled to the step's ops,
    ``SHARES.auto_seconds``). ``uniform``: stages the SPMD program (``spmd_program``) runs: ``_uniform``
    replaces the stage DP, and the step is priced as that program runs (``simulate``, lockstep); ``spread_tail``
    lets it spread the layers after the blocks over several stages where that is faster (``_uniform``).
    ``modes``: recompute modes each stage of the stage DP may choose (``graph`` is ``modes``' last; the
    module docstring's "Recompute per stage"); the plan's ``recompute`` then says which block does what, and
    ``modes.graph_of(plan.recompute)`` is the graph it plans. ``deadline``: the whole planning call's
    (``planner.deadline``); once it is spent, the layers are priced on one logical layout per submesh
    shape (not also as 2-D meshes), the layers other than the block only on the shapes priced by then
    (``price_layers``), and each stage is its layers' plans joined, not solved whole (``_planned_whole``),
    each cut recorded on it.

    The layers' and stages' sub-graphs are cut once each (``partition.subgraph``) and live with ``graph``
    while it is planned here; they are dropped when this returns (the step's graph lives on to be
    emitted)."""
    try:
        return _plan_pipeline(graph, cost, hardware=hardware, memory_budget=memory_budget,
                              num_microbatches=num_microbatches, schedule_name=schedule_name, num_layers=num_layers,
                              time_budget_s=time_budget_s, max_stages=max_stages, forced_boundaries=forced_boundaries,
                              stage_shape=stage_shape, num_chunks=num_chunks, uniform=uniform,
                              spread_tail=spread_tail, modes=modes, deadline=deadline)
    finally:
        for g in (graph, *([] if modes is None else modes.planned())):
            g.memo("pipeline.partition.subgraph").clear()


def _plan_pipeline(graph: Graph, cost: CostModel, *, hardware: str, memory_budget: float | None,
                   num_microbatches: int, schedule_name: str, num_layers: int | None, time_budget_s: float | None,
                   max_stages: int | None, forced_boundaries: Sequence[int], stage_shape: tuple[int, int] | None,
                   num_chunks: int, uniform: bool, spread_tail: bool, modes: StageModes | None,
                   deadline: Deadline | None) -> PipelinePlan:
    """``plan_pipeline`` in its phases (the module docstring's steps): the options checked and the step cut
    into layers; the layers priced on the submesh options (``price_layers``); the stages chosen
    (``_chosen_uniform`` for the SPMD program, ``_chosen_interleaved``, else the stage DP ``_chosen_by_dp``);
    each planned whole (``_planned_whole``); the plan priced and assembled (``_assembled``)."""
    t_start = time.perf_counter()
    if time_budget_s is None:
        time_budget_s = SHARES.auto_seconds(len(graph.ops))
    interleaved, v_shape, pricing = _schedule_options(schedule_name, uniform, stage_shape, num_chunks,
                                                      num_microbatches)
    cluster = cluster_of(cost.mesh)
    parts = split_step(graph)
    blocks = 0
    if uniform:  # the uniform cut falls between blocks, the tail a layer of its own (``_block_boundaries``)
        forced_boundaries, blocks = _block_boundaries(graph, parts, forced_boundaries)
    lay = _layered(graph, parts, num_layers, forced_boundaries)
    layers = lay.layers
    options = _layouts(_submeshes(cluster, stage_shape, batch_rows(graph)))
    late = deadline is not None and deadline.spent()  # the call's budget is spent: the quickest plan that fits
    if late and not interleaved and any(view is not None for _, view in options):
        # each shape priced as it is only: a one-host shape's 2-D views cost a layer solve each, and the most
        # to build (GPT-1.3B's block on 2x2: 5 s, against 0.5 s on 1x4)
        assert deadline is not None
        deadline.cut(f"the pipeline's layers were priced on {sum(v is None for _, v in options)} submesh shapes "
                     f"as they are, not also on their {sum(v is not None for _, v in options)} 2-D layouts")
        options = tuple(o for o in options if o[1] is None)
    n_devices = cluster[0] * cluster[1]
    chunks = num_chunks if interleaved else 2 if v_shape else 1
    limit = min(max_stages or layers, layers)  # stages at most (interleaved: the stage shape's count)
    if interleaved:
        limit = n_devices // (options[0][0][0] * options[0][0][1])
    if uniform:  # price only the shapes a uniform cut can use
        tried_shapes = sorted({o[0] for o in options})
        options = tuple(o for o in options if _uniform_count(o[0], cluster, blocks, limit, chunks))
        if not options:
            raise _no_uniform_cut(blocks, [], chunks, {f"{h}x{d}": n for h, d in tried_shapes
                                                       if (n := n_devices // (h * d)) >= 2})
    submeshes = tuple(shape for shape, _ in options)  # a one-host shape once per logical layout of it
    costs = [submesh_cost(cost, shape, view) for shape, view in options]  # one per option: they cache prices
    slow = min(link.bandwidth for link in cost.mesh.links)
    if interleaved and layers < chunks * limit:
        raise PipelineError(f"{limit} stages of {chunks} chunks need at least {chunks * limit} layers; the step "
                            f"has {layers}: pass num_layers >= {chunks * limit} or fewer chunks")
    try:
        inflight = inflight_rule(pricing, limit, num_microbatches, chunks)
        by_chunk = chunk_inflight_rule(pricing, limit, num_microbatches, chunks) if chunks > 1 else None
    except ValueError as e:
        raise PipelineError(str(e)) from None

    # ---- the stage problem ----
    # layer prices depend on these and on the graph: a cheaper recompute mode's, made when it was planned
    # alone (``pipeline.recompute``), serve again as a per-stage option (``modes``)
    pricing_key = (id(cost), hardware, memory_budget, options, n_devices, num_microbatches, pricing, chunks, limit,
                   num_layers, tuple(forced_boundaries))

    # the graphs still to price share the layer pricing's seconds
    unpriced = 1 + (0 if modes is None or uniform or interleaved else sum(
        pricing_key not in g.memo("pipeline.stages.layer_prices") for _, g in modes.graphs[:-1]))

    def priced(lay: _Layered) -> LayerPrices:
        memo = lay.graph.memo("pipeline.stages.layer_prices")
        if pricing_key not in memo:
            memo[pricing_key] = price_layers(
                lay.graph, lay.micro_ops, lay.update_ops, costs, hardware, memory_budget,
                SHARES.layer_pricing * time_budget_s / unpriced, inflight, n_devices, num_microbatches, chunks,
                by_chunk, deadline)
        return memo[pricing_key]

    prices = priced(lay)
    # the DP's time per microbatch: t' = t + u / B (the module docstring, step 3)
    # a cut's activations cross on every device's own link at once (each sends and receives its shard)
    link = np.array([slow * a * b for a, b in submeshes])
    stage_time = _stage_times(prices.micro_time + prices.update_time / num_microbatches, lay.into, link)
    log.info("priced %d layers (%d distinct) on %d submesh shapes in %.1f s", layers, prices.distinct,
             len(submeshes), time.perf_counter() - t_start)
    _refuse_hopeless_layers(prices, submeshes, memory_budget, inflight)
    setting = _Setting(cost=cost, hardware=hardware, memory_budget=memory_budget, num_microbatches=num_microbatches,
                       schedule_name=schedule_name, interleaved=interleaved, uniform=uniform,
                       time_budget_s=time_budget_s, t_start=t_start, deadline=deadline, cluster=cluster,
                       submeshes=submeshes, costs=costs, link=link, limit=limit)
    if uniform:  # interleaved or not: the SPMD program's cut, its tail spread over stages where that is faster
        cut = _chosen_uniform(setting, lay, prices, stage_time, pricing, chunks, spread_tail)
    elif interleaved:
        cut = _chosen_interleaved(setting, lay, prices, stage_time, pricing, chunks, inflight, by_chunk)
    else:
        cut = _chosen_by_dp(setting, lay, prices, stage_time, priced, pricing, inflight, modes, num_layers,
                            forced_boundaries)
    if (uniform or interleaved) and modes is not None:  # every stage in the graph's own mode (the lockstep SPMD
        # program gains nothing from a cheaper one on some stages: each tick lasts as long as its slowest stage)
        cut.recompute = modes.config(modes.graphs[-1][0])
    t_dp = time.perf_counter() - t_start
    planned = _planned_whole(setting, cut, prices)
    return _assembled(setting, cut, planned, prices, t_dp)


def _schedule_options(schedule_name: str, uniform: bool, stage_shape: tuple[int, int] | None, num_chunks: int,
                      num_microbatches: int) -> tuple[bool, bool, str]:
    """``(interleaved, v_shape, pricing)`` of the schedule asked for, or the error that says what to change:
    ``pricing`` is the schedule the stages are cut and planned for ("auto" cuts for 1F1B, whose microbatches
    in flight ZB-H1 shares, then picks)."""
    if schedule_name not in (*SCHEDULE_NAMES, *V_SCHEDULES, "auto"):
        raise PipelineError(f"schedule {schedule_name!r}: expected one of "
                            f"{', '.join((*SCHEDULE_NAMES, *V_SCHEDULES))} or 'auto'")
    if schedule_name in V_SCHEDULES and not uniform:
        raise PipelineError(f"schedule {schedule_name!r} runs two chunks a stage in a V, which only the SPMD program "
                            "runs: plan with uniform=True (runtime='spmd'), or use 'zb-h1'")
    interleaved = schedule_name == "interleaved-1f1b"
    v_shape = schedule_name in V_SCHEDULES  # ZB-V asked for (under "auto", ``_uniform`` may choose it)
    if interleaved and (stage_shape is None or num_chunks < 2):
        raise PipelineError("the interleaved schedule runs on a given stage layout with several model chunks "
                            f"per stage: pass stage_shape=(hosts, devices) and num_chunks >= 2 (got "
                            f"stage_shape={stage_shape}, num_chunks={num_chunks}), or use '1f1b'")
    if num_microbatches < 1:
        raise PipelineError(f"num_microbatches must be >= 1, got {num_microbatches}")
    return interleaved, v_shape, "1f1b" if schedule_name == "auto" else schedule_name


def _block_boundaries(graph: Graph, parts: Any, forced: Sequence[int]) -> tuple[list[int], int]:
    """``forced`` with a layer ending where each repeated block starts, and after the last one (the uniform
    cut falls between blocks; the tail, what follows the last block, is a layer of its own, which the SPMD
    program may spread over stages: ``_uniform``), and the number of blocks."""
    fwd, _, _ = forward_sequence(graph, parts)
    starts: dict[str, int] = {}
    end = -1
    for k, i in enumerate(fwd):
        tag = graph.ops[i].layer
        if tag and tag not in starts:
            starts[tag] = k
        if tag:
            end = k
    bounds = sorted({*forced, *(k - 1 for k in list(starts.values())[1:] if k > 0),
                     *((end,) if 0 <= end < len(fwd) - 1 else ())})
    return bounds, len(starts)


@dataclasses.dataclass(frozen=True, slots=True)
class _Setting:
    """What every phase of ``_plan_pipeline`` reads: the call's options, resolved, and the submesh options the
    layers were priced on (``submeshes``, a cost model each in ``costs``, the bandwidth a cut's activations
    cross at in ``link``); ``limit``: the stages at most."""

    cost: CostModel
    hardware: str
    memory_budget: float | None
    num_microbatches: int
    schedule_name: str  # as asked, "auto" included
    interleaved: bool
    uniform: bool
    time_budget_s: float
    t_start: float
    deadline: Deadline | None
    cluster: tuple[int, int]
    submeshes: tuple[tuple[int, int], ...]
    costs: Sequence[CostModel]
    link: np.ndarray
    limit: int


@dataclasses.dataclass(slots=True)
class _Chosen:
    """The stages a cut chose, before they are planned whole: ``chosen`` (first layer, last layer, submesh
    option) per (virtual) stage and ``placement`` their origins; the cut's own cost and search; the schedule
    it was priced for (``pricing``) with its form (fused ticks, chunks, a V, the tail's spread and seconds)
    and microbatches in flight (per stage from the end, and per chunk); the layer prices and stage tables
    each stage's times come from (its recompute mode's, with ``modes``); ``recompute`` where the stages chose
    their own; ``lay`` the layering they cut (the step rewritten with those modes)."""

    lay: _Layered
    chosen: list[tuple[int, int, int]]
    placement: list[tuple[int, int]]
    dp_cost: float
    dp_seconds: float
    dp_candidates: int
    pricing: str
    inflight: tuple[int, ...]
    by_chunk: tuple[tuple[int, ...], ...] | None
    chunks: int
    stage_prices: list[LayerPrices]
    stage_tables: list[np.ndarray]
    fused: bool = False
    split: int = 1
    tail_time: float = 0.0
    recompute: dict[str, str] | None = None

    @property
    def v_shape(self) -> bool:
        return self.pricing in V_SCHEDULES

    @property
    def num_stages(self) -> int:  # physical
        return len(self.chosen) // self.chunks

    @property
    def places(self) -> list[tuple[int, int]]:
        """``(stage, chunk)`` of each virtual stage (``place``)."""
        return [place(u, self.num_stages, self.v_shape) for u in range(len(self.chosen))]


def _chosen_uniform(st: _Setting, lay: _Layered, prices: LayerPrices, stage_time: np.ndarray, pricing: str,
                    chunks: int, spread_tail: bool) -> _Chosen:
    """The SPMD program's stages (``_uniform``), every one priced from the graph's own layer prices."""
    graph, parts = lay.graph, lay.parts
    cut = _uniform(
        graph, parts, lay.layer_of_op, stage_time, prices, st.submeshes, st.cluster, st.num_microbatches,
        st.memory_budget, pricing, st.limit, st.costs, lay.into, st.cost, zero_bubble=st.schedule_name == "auto",
        spread_rows=tail_spreadable(graph, parts) if spread_tail else 0,
        tail_first=_last_block_layer(graph, parts, lay.layer_of_op) + 1, chunks=chunks)
    n = len(cut.stages)
    return _Chosen(lay=lay, chosen=cut.stages, placement=cut.origins, dp_cost=cut.time,
                   dp_seconds=time.perf_counter() - st.t_start, dp_candidates=len(st.submeshes), pricing=cut.schedule,
                   inflight=cut.inflight, by_chunk=cut.by_chunk, chunks=cut.chunks, stage_prices=[prices] * n,
                   stage_tables=[stage_time] * n, fused=cut.fused, split=cut.tail_split, tail_time=cut.tail_time)


def _chosen_interleaved(st: _Setting, lay: _Layered, prices: LayerPrices, stage_time: np.ndarray, pricing: str,
                        chunks: int, inflight: tuple[int, ...], by_chunk: Any) -> _Chosen:
    """The interleaved layout (``_interleaved``): every option is the one stage shape, laid out differently;
    the fastest cut over those that have one."""
    cuts = []
    refusal: PipelineDoesNotFit | None = None
    for m in range(len(st.submeshes)):
        try:
            cuts.append(_interleaved(stage_time[:, :, m], st.limit, chunks, st.cluster, st.submeshes[m], m))
        except PipelineDoesNotFit as e:
            refusal = e
    if not cuts:
        assert refusal is not None
        raise refusal
    chosen, placement, dp_cost = min(cuts, key=lambda r: r[2])
    n = len(chosen)
    return _Chosen(lay=lay, chosen=chosen, placement=placement, dp_cost=dp_cost,
                   dp_seconds=time.perf_counter() - st.t_start, dp_candidates=0, pricing=pricing, inflight=inflight,
                   by_chunk=by_chunk, chunks=chunks, stage_prices=[prices] * n, stage_tables=[stage_time] * n)


def _chosen_by_dp(st: _Setting, lay: _Layered, prices: LayerPrices, stage_time: np.ndarray, priced: Any,
                  pricing: str, inflight: tuple[int, ...], modes: StageModes | None, num_layers: int | None,
                  forced_boundaries: Sequence[int]) -> _Chosen:
    """The stage DP's cut (``solvers.solve_inter_op``; module docstring, step 3). A stage's options: every
    submesh layout, in every recompute mode ``modes`` offers (cheapest first; option ``v·M + m`` is layout
    ``m`` in mode ``v``), the tables side by side (the solver takes a shape more than once); without
    ``modes``, the graph's own mode alone. A chosen stage whose layers' plans joined overflow the budget is
    struck and the DP runs again (``MAX_RECUTS``)."""
    layers, memory_budget, submeshes, costs = lay.layers, st.memory_budget, st.submeshes, st.costs
    variants = _variants(modes, lay, prices, stage_time, priced, num_layers, forced_boundaries,
                         st.num_microbatches, st.link)
    M = len(submeshes)
    composed = [_ComposedMemory(v.lay.graph, v.prices, v.lay.micro_ops, v.lay.update_ops, costs, st.num_microbatches)
                for v in variants]
    all_time = np.concatenate([v.stage_time for v in variants], axis=2)
    for attempt in range(MAX_RECUTS + 1):
        problem = InterOpProblem(num_layers=layers, cluster=st.cluster, stage_time=all_time,
                                 num_microbatches=st.num_microbatches, submeshes=submeshes * len(variants),
                                 static_memory=np.concatenate([_static_memory(v.prices) for v in variants], 2),
                                 activation_memory=np.concatenate(
                                     [_range_sums(v.prices.micro_memory) for v in variants], 2),
                                 memory_limit=memory_budget, inflight=inflight, max_stages=st.limit)
        try:
            sol = solve_inter_op(problem)
        except InterOpInfeasibleError as e:
            raise PipelineDoesNotFit(f"no pipeline of {layers} layers fits: {e}") from None
        if sol.placement is None:
            raise PipelineError(f"the chosen submeshes {sol.submesh_shapes(problem)} do not tile the "
                                f"cluster {st.cluster}")
        chosen = [(s.first_layer, s.last_layer, s.submesh) for s in sol.stages]
        # the DP adds its layers' memory; the layers' plans joined may hold more (module docstring)
        over = [] if memory_budget is None or attempt == MAX_RECUTS else [
            (a, b, o) for r, (a, b, o) in enumerate(chosen)
            if composed[o // M](a, b, o % M, inflight[len(chosen) - 1 - r]) > memory_budget * (1 + 1e-6)]
        if not over:
            break
        all_time = all_time.copy()
        for first, last, o in over:
            log.info("layers %d..%d on %s%s: their plans joined overflow the stage's memory; cut "
                     "again without that stage", first, last, costs[o % M].mesh,
                     "" if len(variants) == 1 else f" ({describe(variants[o // M].mode)})")
            all_time[first, last, o] = np.inf
            composed[o // M].forget(first, last)
    stage_variant = [variants[o // M] for _, _, o in chosen]
    chosen = [(a, b, o % M) for a, b, o in chosen]
    recompute = None
    if modes is not None:
        recompute, mixed = _per_stage_recompute(modes, lay, chosen, [v.mode for v in stage_variant])
        if mixed is not lay.graph:
            lay = stage_variant[0].lay if mixed is stage_variant[0].lay.graph else _aligned(
                _layered(mixed, split_step(mixed), num_layers, forced_boundaries), lay, "per stage")
        if len({v.mode for v in stage_variant}) > 1:
            log.info("recompute chosen per stage: %s", ", ".join(
                f"stage {s} {v.mode}" for s, v in enumerate(stage_variant)))
    return _Chosen(lay=lay, chosen=chosen, placement=list(sol.placement), dp_cost=sol.cost,
                   dp_seconds=sol.stats.seconds, dp_candidates=sol.stats.candidates, pricing=pricing,
                   inflight=inflight, by_chunk=None, chunks=1, stage_prices=[v.prices for v in stage_variant],
                   stage_tables=[v.stage_time for v in stage_variant], recompute=recompute)


def _planned_whole(st: _Setting, cut: _Chosen, prices: LayerPrices) -> dict[int, Part]:
    """The chosen stages re-planned whole (module docstring, step 4), by (virtual) stage. Identical stages
    (same ops on the same submesh shape) are planned once, for the most microbatches in flight among them:
    fewer in flight need less memory, so that plan fits them all, and one solve with their pooled time beats
    several short ones (short solves of large stages vary a lot); their memory is so an upper bound for those
    holding fewer."""
    lay, chosen, num_stages = cut.lay, cut.chosen, cut.num_stages
    graph, micro_ops, update_ops = lay.graph, lay.micro_ops, lay.update_ops
    stage_ops = [([i for ell in range(a, b + 1) for i in micro_ops[ell]],
                  [i for ell in range(a, b + 1) for i in update_ops[ell]]) for a, b, _ in chosen]
    # a chunk counts its own microbatches in flight (``Schedule.peak_inflight_by_chunk``), a stage all of its
    held = [cut.by_chunk[num_stages - 1 - s][c] if cut.by_chunk is not None else cut.inflight[num_stages - 1 - s]
            for s, c in cut.places]
    keys = [(signature(graph, m) + signature(graph, u), c[2])
            for (m, u), c in zip(stage_ops, chosen, strict=True)]
    # their share of the budget, or what the pricing, the DP's re-cuts and the stages planned before left of
    # it: a solve given t seconds takes ~1.3 t with its problem's build and seeds (GPT-15B's two stages on 1x8,
    # 16.8 s solves took ~20 s each, past a 120 s budget)
    per_solve = SHARES.stage_plans * st.time_budget_s / (2 * len(set(keys)))
    done: dict[Any, Part] = {}

    def stage_seconds() -> float | None:
        """A stage's solve seconds, or None once the call's budget is spent: the stage is then its layers' plans
        joined (the start every stage solve has), not solved (``plan_graph(solve=False)``)."""
        left = st.time_budget_s - (time.perf_counter() - st.t_start)
        if st.deadline is not None and st.deadline.spent():
            st.deadline.cut("the pipeline's stages are their layers' plans joined, not solved whole")
            return None
        return max(SHARES.min_stage_seconds, min(per_solve, left / (1.3 * 2 * len(set(keys) - set(done)))))

    est = None
    if cut.v_shape:
        # a stage's two chunks in a V hold its 2S chunk-microbatches between them, split unevenly (stage 0:
        # 2S - 1 and 1) and the other way on another stage: two identical chunks (same ops, same shape) are
        # planned once for all stages, at their stage's mean in flight, each under half the stage's budget
        # (both hold what the stage holds); other chunks (the head's, the tail's) share it by what their
        # layers hold at their own count
        for s in range(num_stages):
            u0, u1 = s, 2 * num_stages - 1 - s
            if keys[u0] == keys[u1]:
                held[u0] = held[u1] = (held[u0] + held[u1]) / 2
        static, active = _static_memory(prices), _range_sums(prices.micro_memory)
        est = [float(static[a, b, m] + held[u] * active[a, b, m]) for u, (a, b, m) in enumerate(chosen)]
    shares = _chunk_budgets(prices, chosen, keys, num_stages, st.memory_budget, cut.v_shape, est)
    planned: dict[int, Part] = {}
    for s in sorted(range(len(chosen)), key=lambda u: (-held[u], u)):
        first, last, m = chosen[s]
        mops, uops = stage_ops[s]
        part = _reused(graph, done.get(keys[s]), mops, uops)
        if part is None:
            # the stage's own budget: its update state once, its activations once per microbatch in flight
            # started from the layers' own plans, the layouts behind the stage DP's prices
            ells = range(first, last + 1)
            layer_micro = [cut.stage_prices[s].parts[ell][m].micro for ell in ells]
            layer_update = [cut.stage_prices[s].parts[ell][m].update for ell in ells]
            mine_micro, mine_update = [micro_ops[ell] for ell in ells], [update_ops[ell] for ell in ells]
            starts = ((layouts_of_layers(graph, layer_micro, mine_micro, mops),
                       assignment_of_layers(graph, layer_micro, mine_micro, mops)),
                      (layouts_of_layers(graph, layer_update, mine_update, uops),
                       assignment_of_layers(graph, layer_update, mine_update, uops)))
            budget = shares[keys[s]]
            seconds = stage_seconds()
            part = plan_part(graph, mops, uops, st.costs[m], st.hardware, budget,
                             SHARES.min_layer_seconds if seconds is None else seconds, float(held[s]),
                             microbatches=st.num_microbatches, starts=starts, solve=seconds is not None)
            # the layer's plan, made on it or on an identical layer (``price_layers``), carried to its ops
            layer = _reused(graph, cut.stage_prices[s].parts[first][m], mops, uops) if first == last else None
            if layer is not None and layer.micro.feasible and layer.update.feasible and (
                    not part.micro.feasible or not part.update.feasible
                    or (layer.time + layer.once < part.time + part.once
                        and (budget is None or layer.memory <= budget * (1 + 1e-6)))):
                # a one-layer stage is its layer: the layer's price (planned for as many microbatches in
                # flight or more) stands when the stage's own short solve did worse or found nothing
                part = layer
            done[keys[s]] = part
        planned[s] = part
    return planned


def _assembled(st: _Setting, cut: _Chosen, planned: Mapping[int, Part], prices: LayerPrices,
               t_dp: float) -> PipelinePlan:
    """The plan of the stages ``planned`` whole: each stage's time with its activations in and cotangents out,
    the schedules priced on them (``simulate``: the SPMD program's lockstep ticks, or the MPMD runtime's
    timeline with its host beside it; under "auto" the faster of ``AUTO_SCHEDULES``), refused when a stage
    holds more than the budget."""
    lay, chosen, chunks, num_stages, places = cut.lay, cut.chosen, cut.chunks, cut.num_stages, cut.places
    graph, parts, layer_of_op, into = lay.graph, lay.parts, lay.layer_of_op, lay.into
    # where the stages chose their recompute, each says what its blocks do
    labels = [summary({b: (cut.recompute or {}).get(b, "none") for ell in range(a, c + 1) for b in lay.blocks[ell]})
              for a, c, _ in chosen]
    if len(set(labels)) < 2:
        labels = [""] * len(chosen)
    stages: list[StagePlan] = []
    for s, (first, last, m) in enumerate(chosen):
        shape = st.submeshes[m]
        part = planned[s]
        log.info("stage %d (layers %d..%d) on %dx%d planned: %s per microbatch (the DP's sum of its "
                 "layers: %s)", s, first, last, *shape, human_time(part.time + 2 * into[first] / st.link[m]),
                 human_time(float(cut.stage_tables[s][first, last, m]
                                  - cut.stage_prices[s].update_time[first:last + 1, m].sum() / st.num_microbatches)))
        if part.micro.plan is None and any(lay.micro_ops[ell] for ell in range(first, last + 1)):
            raise PipelineError(f"stage {s} (layers {first}..{last}) on {shape} did not plan "
                                "within the memory budget when planned whole")
        stages.append(StagePlan(
            layers=(first, last), submesh=shape, origin=cut.placement[s],
            mesh=st.costs[m].mesh, micro_time=part.time + 2 * into[first] / st.link[m],
            update_time=part.once, memory=part.memory, specs=remap(part.micro),
            update_specs=remap(part.update), recompute=labels[s],
        ))
    times = [s.micro_time for s in stages]
    names = AUTO_SCHEDULES if st.schedule_name == "auto" and num_stages > 1 and not st.uniform else (cut.pricing,)
    per_stage = [[u for u in range(len(stages)) if places[u][0] == s] for s in range(num_stages)]  # its chunks
    updates = [sum(stages[u].update_time for u in us) for us in per_stage]  # once a step, after the passes
    if st.uniform:  # the SPMD program's lockstep ticks, interleaved or not
        priced = {cut.pricing: _lockstep_time(cut.pricing, stages, into, st.cost, st.num_microbatches, cut.fused,
                                              chunks, cut.split, cut.tail_time, updates)}
    else:  # the single-process runtime: the stages' passes, and the host issuing them (``pipeline.host``)
        host = _host_work(graph, parts, layer_of_op, chosen, num_stages, st.num_microbatches, names, st.cost)
        priced = {name: _pipeline_time(name, times, num_stages, st.num_microbatches, chunks, host[name].seconds,
                                       updates) for name in names}
    chosen_schedule = min(names, key=lambda name: priced[name].passes)  # the first of equals: 1F1B
    timing = priced[chosen_schedule]
    host_time = 0.0 if st.uniform else host[chosen_schedule].seconds
    if len(names) > 1:
        log.info("schedule %s chosen (%s)", chosen_schedule,
                 ", ".join(f"{name}: {human_time(t.passes)} of pipeline" for name, t in priced.items()))
    held_bytes = [sum(stages[u].memory for u in us) for us in per_stage]
    worst = int(np.argmax(held_bytes))
    if st.memory_budget is not None and held_bytes[worst] > st.memory_budget * (1 + 1e-6):
        # the interleaved cut is chosen by time alone, and a stage priced from a layer planned under a
        # fallback budget can exceed it: a plan over the budget is refused, never returned
        what = "it holds"
        if st.interleaved:
            what = f"its {chunks} chunks (" + ", ".join(
                f"layers {stages[u].layers[0]}..{stages[u].layers[1]}: {stages[u].memory / 1e9:.3g} GB"
                for u in per_stage[worst]) + ") hold"
        raise PipelineDoesNotFit(
            f"stage {worst} does not fit: {what} {held_bytes[worst] / 1e9:.4g} GB per device with "
            f"{cut.inflight[num_stages - 1 - worst]} microbatch(es) in flight, over the budget of "
            f"{st.memory_budget / 1e9:.4g} GB; use more microbatches (smaller ones), recompute, more devices per "
            "stage, or another schedule")
    if st.uniform:  # the cut the SPMD program makes of these stages must be one it runs (``uniform_stages``):
        # the same blocks a stage, differing only in their weights (a ResNet's downsampling first blocks fail)
        uniform_stages(graph, len(chosen), parts, row_shaped(graph))
    report = PipelineReport(dp_cost=cut.dp_cost, layer_solves=prices.solves, distinct_layers=prices.distinct,
                            dp_seconds=cut.dp_seconds, dp_candidates=cut.dp_candidates,
                            stage_costing_seconds=t_dp, planning_seconds=time.perf_counter() - st.t_start,
                            schedules={name: t.passes for name, t in priced.items()} if len(names) > 1 else None)
    return PipelinePlan(
        mesh=st.cost.mesh, hardware=st.hardware, num_microbatches=st.num_microbatches, schedule=chosen_schedule,
        num_layers=lay.layers, stages=tuple(stages), layer_of_op=layer_of_op, predicted_step_time=timing.step,
        bubble_fraction=timing.bubble_fraction, peak_memory=max(held_bytes), memory_budget=st.memory_budget,
        solver=report, graph_digest=graph_digest(graph), num_chunks=chunks, inputs=input_signature(graph),
        fused_ticks=cut.fused, spmd=st.uniform, tail_split=cut.split, tail_time=cut.tail_time, host_time=host_time,
        **({} if cut.recompute is None else {"recompute": cut.recompute}),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _UniformCut:
    """What ``_uniform`` chose: the (virtual) stages as ``(first layer, last layer, m)``, their origins, the
    tick loop's seconds, whether its ticks are fused, the in-flight rule per stage (indexed from the end;
    chunk-microbatches when interleaved) and per chunk (``Schedule.peak_inflight_by_chunk``; None without
    chunks), the schedule's name, and the tail's spread ``G`` (1: on the last stage) and seconds."""

    stages: list[tuple[int, int, int]]
    origins: list[tuple[int, int]]
    time: float
    fused: bool
    inflight: tuple[int, ...]
    by_chunk: tuple[tuple[int, ...], ...] | None
    schedule: str
    tail_split: int
    tail_time: float
    chunks: int = 1  # model chunks a stage (2 for ZB-V, whose chunks run in a V: ``place``)


def _uniform(graph: Graph, parts: Any, layer_of_op: Sequence[int], stage_time: np.ndarray, prices: Any,
             submeshes: Sequence[tuple[int, int]], cluster: tuple[int, int], num_microbatches: int,
             memory_budget: float | None, pricing: str, limit: int, costs: Sequence[CostModel],
             into: np.ndarray, cost: CostModel, zero_bubble: bool = False, spread_rows: int = 0,
             tail_first: int = 0, chunks: int = 1) -> _UniformCut:
    """The stages the SPMD program runs (``spmd_program.uniform_stages``): ``S`` equal submeshes tiling the
    cluster, ``V = v·S`` virtual stages (``v = chunks`` model chunks a stage, 1 but for the interleaved
    schedule) of ``K / V`` of the step's ``K`` repeated blocks each, the layers before the first block with
    virtual stage 0 and those after the last with ``V-1``; virtual stage ``u`` on stage ``u mod S`` (in a V,
    ``place``). Over
    every submesh option ``m`` whose stage count ``S = N / n_m`` makes ``V`` divide ``K`` (and is at most
    ``limit``), with the stage DP's tables ``t'[a_u, b_u, m]`` (``a_u, b_u``: virtual stage u's layers) as
    their times:

        T(m, form) = ticks.price(t', form's tick tables).loop      (lockstep ticks, two exchanges a tick,
                                                                   on InfiniBand when stages span hosts)

    under ``Σ_{u ≡ s} σ[a_u, b_u, m] + inflight_form(u)·α[a_u, b_u, m] <= budget`` per stage (``inflight(u)``:
    what the schedule holds of virtual stage ``u``'s microbatches); the fastest ``(m, form)`` wins. For 1F1B
    both tick forms are priced: one action a tick (``ticks.ticks``: ``S − s`` microbatches in flight, a
    forward waits for the slowest backward) and fused (``ticks.fused_1f1b``: a forward and a backward a
    tick, ``2(S − 1 − s) + 1`` in flight). With ``zero_bubble`` (the schedule left to the planner) ZB-H1's
    unit ticks too: every action (``F``, ``B`` the input gradient, ``W`` the weight gradient) about one
    forward long, so the lockstep costs little over the asynchronous schedule, with 1F1B's microbatches in
    flight (held until ``W``), and ZB-V's cut (``2S`` virtual stages of ``K / 2S`` blocks, chunk 1 of stage
    ``s`` holding virtual stage ``2S − 1 − s``: ``place``) with its unit ticks, its chunks' own microbatches
    in flight, its tail on stage 0 beside the head. The interleaved schedule has the one form, its unit ticks.

    With ``spread_rows`` (the microbatch's rows, when the tail can be spread: ``tail_spreadable``) each form
    is priced a second way, the tail (the layers from ``tail_first`` on, after the last block,
    ``τ_m = Σ_ell t_micro[ell, m]``, ``_tail_seconds``) spread over ``G`` stages (``_tail_split``: the
    largest divisor of the rows up to ``S``; the last ``G``, or in a V the first ``G``, ``Ticks.tail_stages``):
    the last virtual stage's time less ``τ_m``, ``τ_m / G`` on
    each of the ``G`` stages in the tick after its forward, two exchanges of the stream's slices, a tick
    between the last forward and backward (``schedules``' tail gap, whose schedule holds one more
    microbatch: on the last stage for ZB-H1, on every stage for 1F1B and the interleaved schedule; the
    memory check reads it off the schedule). The chosen stages, planned whole, are checked again
    (``_plan_pipeline``)."""
    tags, span = _block_spans(graph, parts, layer_of_op)
    K, layers = len(tags), stage_time.shape[0]
    static, active = _static_memory(prices), _range_sums(prices.micro_memory)
    best: _UniformCut | None = None
    tried: list[str] = []
    # the cuts to price on each shape: the schedule's chunks, and with the schedule left to the planner
    # (one chunk a stage) ZB-V's two in a V too
    layouts = [(chunks, pricing in V_SCHEDULES)] + ([(2, True)] if zero_bubble and chunks == 1 else [])
    for m, shape in enumerate(submeshes):
        size = shape[0] * shape[1]
        for v, v_shape in layouts:
            S = _uniform_count(shape, cluster, K, limit, v)
            if not S:
                continue
            V = v * S
            n = K // V
            ends = [span[tags[(u + 1) * n - 1]][1] for u in range(V - 1)] + [layers - 1]
            starts = [0] + [e + 1 for e in ends[:-1]]
            if any(span[tags[u * n]][0] < starts[u] for u in range(1, V)):
                tried.append(f"{shape[0]}x{shape[1]}: a block's ops share a layer with the block before")
                continue
            t = [float(stage_time[a, b, m]) for a, b in zip(starts, ends, strict=True)]
            if not np.isfinite(sum(t)):
                tried.append(f"{S} stages of {shape[0]}x{shape[1]}: a stage has no plan")
                continue
            link = cost.cluster.inter_link if shape[0] < cluster[0] else cost.cluster.intra_link
            G = _tail_split(spread_rows, S)  # in a V over the first G stages (stage 0 holds the tail)
            tail = _tail_seconds(prices, tail_first, m) if spread_rows else 0.0
            forms = _tick_forms("zb-v" if v_shape else pricing, S, num_microbatches, v,
                                (1, G) if G > 1 and tail > 0 else (1,), zero_bubble and not v_shape)
            places = [place(u, S, v_shape) for u in range(V)]
            for name, fused, inflight, by_chunk, table, g in forms:
                held = [by_chunk[S - 1 - st][c] if by_chunk is not None else inflight[S - 1 - st] for st, c in places]
                need = [sum(static[starts[u], ends[u], m] + held[u] * active[starts[u], ends[u], m]
                            for u in range(V) if places[u][0] == st) for st in range(S)]
                if memory_budget is not None and max(need) > memory_budget * (1 + 1e-6):
                    worst = int(np.argmax(need))
                    tried.append(f"{S} stages of {shape[0]}x{shape[1]} ({name}{' fused' if fused else ''}"
                                 f"{f', the tail over {g}' if g > 1 else ''}): over the memory budget (stage {worst}: "
                                 f"{need[worst] / 1e9:.4g} GB by its layers' plans)")
                    continue
                total = price(spread_times(t, tail, g), [0.0] * S, table, stream_bytes=float(into[starts[1]]),
                              link=link, inner=size, dispatch=0.0, tail=tail).loop
                log.debug("%d stages of %s, %s%s, tail over %d: %.4g s (tail %.4g s a microbatch)", S, shape,
                          name, " fused" if fused else "", g, total, tail)
                if best is None or total < best.time:
                    origins = [(h, d) for h in range(0, cluster[0], shape[0]) for d in range(0, cluster[1], shape[1])]
                    best = _UniformCut(stages=[(a, b, m) for a, b in zip(starts, ends, strict=True)],
                                       origins=[origins[st] for st, _ in places], time=total, fused=fused,
                                       inflight=inflight, by_chunk=by_chunk, schedule=name, tail_split=g,
                                       tail_time=tail if g > 1 else 0.0, chunks=v)
    if best is None:
        raise _no_uniform_cut(K, tried, chunks)
    S = len(best.stages) // best.chunks
    log.info("uniform stages for the SPMD program: %d stages of %d block(s)%s on %s, %s%s%s", S, K // S,
             f" in {best.chunks} chunks" if best.chunks > 1 else "", costs[best.stages[0][2]].mesh, best.schedule,
             ", fused ticks" if best.fused else "",
             f", the tail spread over {best.tail_split} stages" if best.tail_split > 1 else "")
    return best


def _block_spans(graph: Graph, parts: Any, layer_of_op: Sequence[int]) -> tuple[list[str], dict[str, list[int]]]:
    """The repeated blocks in forward order, and each one's first and last layer."""
    tags: list[str] = []
    span: dict[str, list[int]] = {}
    for i in parts.ops(FORWARD):
        tag = graph.ops[i].layer
        if tag:
            if tag not in span:
                tags.append(tag)
                span[tag] = [layer_of_op[i], layer_of_op[i]]
            span[tag][0] = min(span[tag][0], layer_of_op[i])
            span[tag][1] = max(span[tag][1], layer_of_op[i])
    return tags, span


def _tail_split(rows: int, num_stages: int) -> int:
    """``G``, the stages a tail is spread over: the largest divisor of the microbatch's ``rows`` (0: the
    tail cannot be spread) between 2 and ``num_stages``, or 1 (the tail stays on the last stage)."""
    return max((g for g in range(2, num_stages + 1) if rows % g == 0), default=1) if rows else 1


def _tail_seconds(prices: Any, tail_first: int, m: int) -> float:
    """``τ_m``: the tail's seconds a microbatch (forward and backward of the layers from ``tail_first`` on) on
    submesh option ``m``, the part of the last stage's time a spread moves to the tail's ticks."""
    return float(prices.micro_time[tail_first:, m].sum())


def _tick_forms(pricing: str, S: int, M: int, chunks: int, splits: Sequence[int], zero_bubble: bool) -> list[
        tuple[str, bool, tuple[int, ...], tuple[tuple[int, ...], ...] | None, Any, int]]:
    """The ways ``_uniform`` prices ``S`` stages over ``M`` microbatches, per tail spread ``g`` in
    ``splits``: (schedule, fused, in-flight rule per stage from the end, per chunk (interleaved) or None,
    ``price``'s tick tables, ``g``); see ``_uniform``."""
    forms = []
    for g in splits:
        gap = int(g > 1)
        by_chunk = chunk_inflight_rule(pricing, S, M, chunks, tail_gap=gap) if chunks > 1 else None
        forms.append((pricing, False, inflight_rule(pricing, S, M, chunks, tail_gap=gap), by_chunk,
                      lockstep_tables(pricing, S, M, chunks, tail_split=g), g))
        if pricing == "1f1b":
            forms.append(("1f1b", True, fused_inflight(S, M, g), None,
                          lockstep_tables("1f1b", S, M, fused=True, tail_split=g), g))
            if zero_bubble:
                forms.append(("zb-h1", False, inflight_rule("zb-h1", S, M, tail_gap=gap), None,
                              lockstep_tables("zb-h1", S, M, tail_split=g), g))
    return forms


def _last_block_layer(graph: Graph, parts: Any, layer_of_op: Sequence[int]) -> int:
    """The last layer holding a repeated block's forward ops (the layers after it are the tail)."""
    return max(layer_of_op[i] for i in parts.ops(FORWARD) if graph.ops[i].layer)


def _no_uniform_cut(blocks: int, tried: Sequence[str], chunks: int = 1,
                    counts: Mapping[str, int] | None = None) -> PipelineDoesNotFit:
    """The error for ``blocks`` repeated blocks no uniform cut fits, ``tried`` saying why for each shape tried,
    or ``counts`` the stage count each submesh shape gives (none of which divides the blocks)."""
    shapes = f": {', '.join(f'{k} gives {n}' for k, n in counts.items())}" if counts else ""
    why = "; ".join(tried) or "no submesh shape gives a stage count dividing them" + (
        f" {chunks} chunks a stage" if chunks > 1 else "") + shapes
    needs = "a stage count dividing the block count" if chunks == 1 else \
        f"{chunks} chunks times the stage count to divide the block count"
    return PipelineDoesNotFit(
        f"no uniform cut of the step's {blocks} repeated blocks into equal stages ({why}): the SPMD pipeline "
        f"needs {needs}; pass stage_shape=(hosts, devices) whose stage count divides it, more microbatches, "
        "or recompute")


def _uniform_count(shape: tuple[int, int], cluster: tuple[int, int], blocks: int, limit: int, chunks: int = 1) -> int:
    """The number of equal stages of ``shape`` that tile ``cluster`` when ``chunks`` times it divides ``blocks``
    repeated blocks and it is between 2 and ``limit``; else 0 (no uniform cut on that shape)."""
    size, n_devices = shape[0] * shape[1], cluster[0] * cluster[1]
    S = n_devices // size
    if (n_devices % size or S < 2 or limit < S or not blocks or blocks % (chunks * S) or cluster[0] % shape[0]
            or cluster[1] % shape[1]):
        return 0
    return S


def _lockstep_time(name: str, stages: Sequence[StagePlan], into: np.ndarray, cost: CostModel,
                   num_microbatches: int, fused: bool, chunks: int = 1, tail_split: int = 1,
                   tail: float = 0.0, updates: Sequence[float] = ()) -> Timing:
    """The SPMD program's step, priced (``solvers.pipeline.simulate``, lockstep: ticks, each as long as its
    slowest stage's work, two exchanges a tick; ``fused``: 1F1B's fused ticks; ``chunks``: the interleaved
    schedule's, ``stages`` then one per virtual stage, round the ring; ``tail_split > 1``: the tail, ``tail``
    seconds of the last stage's ``micro_time``, spread over that many stages), then each physical stage's
    ``updates``."""
    S = len(stages) // chunks
    hosts = {st.origin[0] for st in stages}
    link = cost.cluster.inter_link if len(hosts) > 1 else cost.cluster.intra_link
    times = spread_times([st.micro_time for st in stages], tail, tail_split)
    stream = float(into[stages[1].layers[0]]) if len(stages) > 1 else 0.0
    table = lockstep_tables(name, S, num_microbatches, chunks, fused=fused, tail_split=tail_split)
    return simulate(table, lockstep_costs(times, updates, table, stream_bytes=stream, link=link,
                                          inner=stages[0].submesh[0] * stages[0].submesh[1], dispatch=0.0, tail=tail),
                    "lockstep")


def _host_work(graph: Graph, parts: Any, layer_of_op: Sequence[int], chosen: Sequence[tuple[int, int, int]],
               num_stages: int, num_microbatches: int, names: Sequence[str], cost: CostModel) -> dict[str, HostWork]:
    """Per schedule of ``names``, what the MPMD runtime's host does in a step of the ``chosen`` stages
    (``pipeline.host``), priced with what ``cost``'s profile measured of the host."""
    stage_of_layer = {ell: u for u, (a, b, _) in enumerate(chosen) for ell in range(a, b + 1)}
    stage_of_op = [stage_of_layer[ell] for ell in layer_of_op]
    costs = HostCosts.of(cost.profile)
    work: dict[bool, HostWork] = {}
    out = {}
    for name in names:
        split = name in WEIGHT_PASS_SCHEDULES
        if split not in work:
            work[split] = host_work(graph, parts, stage_of_op, num_stages, num_microbatches, weight_pass=split,
                                    costs=costs)
        out[name] = work[split]
    return out


def _pipeline_time(name: str, times: Sequence[float], num_stages: int, num_microbatches: int,
                   chunks: int, host: float = 0.0, updates: Sequence[float] = ()) -> Timing:
    """A step of ``num_microbatches`` under schedule ``name`` on the MPMD runtime, priced: (virtual) stages
    taking ``times`` a microbatch, its host ``host`` seconds a step issuing them, each physical stage's
    ``updates`` once a step: ``simulate(..., "async")`` (``solvers.pipeline.simulate``: each stage at its own
    pace, a backward costing twice a forward, ZB-H1's input- and weight-gradient parts one forward each;
    the passes take ``max(timeline, host)``)."""
    sched = schedule(name, num_stages, num_microbatches, chunks)
    return simulate(sched, Costs.of_micro(times, weight_pass=sched.weight_pass, host=host, update=tuple(updates)),
                    "async")


def _chunk_budgets(prices: Any, chosen: Sequence[tuple[int, int, int]], keys: Sequence[Any], num_stages: int,
                   memory_budget: float | None, v_shape: bool = False,
                   est: Sequence[float] | None = None) -> dict[Any, float | None]:
    """The memory each (virtual) stage is planned under, by its key (identical stages share one plan).

    A physical stage holds all its chunks (``len(chosen) / num_stages`` of them, virtual stages ``p``,
    ``p + S``, ...), so chunk ``u`` gets ``budget · e(u) / Σ_w e(w)`` over the chunks ``w`` of its
    physical stage, ``e`` being what its layers' own plans hold (``LayerPrices.parts``, at their own
    microbatches in flight: the stage DP's view); an equal share where a layer has no finite price. A
    plan made once for identical chunks gets the least of their shares, so it fits beside every partner
    (GPT-1T on 64 stages of 2 chunks: a block beside a block, beside the embedding's chunk, beside the
    head's). Without chunks a stage gets the whole budget."""
    if memory_budget is None or len(chosen) == num_stages:
        return dict.fromkeys(keys, memory_budget)
    if est is None:  # (ZB-V gives its own: ``_plan_pipeline``)
        est = [sum(prices.parts[ell][m].memory for ell in range(a, b + 1)) for a, b, m in chosen]
    out: dict[Any, float | None] = {}
    for u, key in enumerate(keys):
        here = place(u, num_stages, v_shape)[0]
        mates = [w for w in range(len(chosen)) if place(w, num_stages, v_shape)[0] == here]
        total = sum(est[w] for w in mates)
        share = est[u] / total if math.isfinite(total) and total > 0 else 1 / len(mates)
        out[key] = min(out.get(key) or math.inf, memory_budget * share)
    return out


def _interleaved(stage_time: np.ndarray, num_stages: int, chunks: int, cluster: tuple[int, int],
                 shape: tuple[int, int], m: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]], float]:
    """The interleaved layout on ``num_stages`` submeshes of ``shape``: the layers cut into ``V = chunks ·
    num_stages`` contiguous virtual stages minimising the slowest one's time ``t[i, j]``
    (``solvers.inter_op.linear_partition``), virtual stage ``u`` on submesh ``u mod S`` (chunks dealt
    round-robin); submeshes tile the cluster row-major. Returns ``(first layer, last layer, m)`` per virtual
    stage, their origins, the bottleneck."""
    layers, V = stage_time.shape[0], chunks * num_stages
    try:
        groups, slowest = linear_partition(stage_time, V)
    except PartitionInfeasibleError:
        raise PipelineDoesNotFit(f"no cut of {layers} layers into {V} virtual stages fits on {shape}: some layer "
                                 "has no plan within the memory budget there") from None
    origins = [(h, d) for h in range(0, cluster[0], shape[0]) for d in range(0, cluster[1], shape[1])]
    return [(a, b, m) for a, b in groups], [origins[u % num_stages] for u in range(V)], slowest


def _submeshes(cluster: tuple[int, int], stage_shape: tuple[int, int] | None,
               rows: int = 0) -> tuple[tuple[int, int], ...]:
    """Alpa's submesh shapes of the cluster, those of several hosts only for a power-of-two host count, a
    count that divides both the hosts and the microbatch's ``rows``, or all of them; or only
    ``stage_shape`` when it is one of Alpa's and tiles the cluster.

    Every shape costs a solve per distinct layer, and a multi-host one the most to build (GPT-39B's block
    on 8x8: 3.7 s, against 0.1 s on one host); a stage over ``h`` hosts pays the inter-host link inside
    it, which pipelining across those hosts avoids, so such stages are rarely chosen, and a cluster of
    ``H`` hosts keeps ``(2^k, D)`` and ``(H, D)`` (8 hosts: 2, 4 and 8 of Alpa's 7 shapes), which still
    tile it. The time the others took goes to the solves that remain. A stage over ``h`` hosts that
    splits its microbatch's rows ``h`` ways (data parallel over the slow link, its gradients reduced once
    per step) is Megatron's layout, so ``h | gcd(H, rows)`` is kept too: GPT-1T's 3-row microbatches on
    384 hosts need ``(3, 8)``, which no power of two gives."""
    submeshes = alpa_submeshes(cluster)
    if stage_shape is None:
        hosts = cluster[0]
        return tuple(s for s in submeshes if s[0] == 1 or s[0] == hosts or not s[0] & (s[0] - 1)
                     or (rows > 0 and hosts % s[0] == 0 and rows % s[0] == 0))
    stage_shape = (int(stage_shape[0]), int(stage_shape[1]))
    if stage_shape not in submeshes or (cluster[0] * cluster[1]) % (stage_shape[0] * stage_shape[1]):
        raise PipelineError(f"stage_shape {stage_shape} is not one of the submesh shapes of the "
                            f"{cluster[0]}x{cluster[1]} cluster that tile it: {list(submeshes)}")
    return (stage_shape,)


# ``schedule_name="auto"``: the schedules priced on the stages planned for 1F1B, the faster kept (the first
# of equals). GPipe is 1F1B's time with more microbatches in flight; interleaving needs a stage layout given.
AUTO_SCHEDULES = ("1f1b", "zb-h1")
MAX_RECUTS = 4  # stage DP runs after the first whose stages' joined plans overflow (then planned whole)


@dataclasses.dataclass(frozen=True, slots=True)
class _Layered:
    """A microbatch step cut into layers: each op's layer, each layer's microbatched and update ops, the
    bytes crossing into each layer (``X(i)``) and the blocks each layer's forward ops belong to."""

    graph: Graph
    parts: Any
    layer_of_op: list[int]
    micro_ops: list[list[int]]
    update_ops: list[list[int]]
    into: np.ndarray
    blocks: tuple[frozenset[str], ...]

    @property
    def layers(self) -> int:
        return len(self.micro_ops)


def _layered(graph: Graph, parts: Any, num_layers: int | None, forced: Sequence[int]) -> _Layered:
    """``graph`` cut into layers (``partition.assign_layers``)."""
    layer_of_op = assign_layers(graph, parts, num_layers, forced=forced)
    layers = max(layer_of_op) + 1
    micro_ops: list[list[int]] = [[] for _ in range(layers)]
    update_ops: list[list[int]] = [[] for _ in range(layers)]
    blocks: list[set[str]] = [set() for _ in range(layers)]
    for op in graph.ops:
        (update_ops if parts.kind[op.id] == UPDATE else micro_ops)[layer_of_op[op.id]].append(op.id)
        if parts.kind[op.id] == FORWARD and op.layer:
            blocks[layer_of_op[op.id]].add(op.layer)
    return _Layered(graph, parts, layer_of_op, micro_ops, update_ops,
                    _bytes_into_layers(graph, parts, layer_of_op, layers), tuple(frozenset(b) for b in blocks))


def _same_layers(lay: _Layered, like: _Layered) -> bool:
    """Whether ``lay``'s layers are ``like``'s: the same blocks' forward ops, the same bytes between them (a
    recompute mode changes only what the backward replays)."""
    return lay.blocks == like.blocks and bool(np.allclose(lay.into, like.into))


def _aligned(lay: _Layered, like: _Layered, what: str) -> _Layered:
    """``lay`` if its layers are ``like``'s (``_same_layers``), else a ``PipelineError``."""
    if not _same_layers(lay, like):
        raise PipelineError(f"the step rewritten with recompute {what} cuts into other layers than as planned "
                            f"({lay.layers} against {like.layers}); fix the recompute mode (recompute=...)")
    return lay


@dataclasses.dataclass(frozen=True, slots=True)
class _Variant:
    """One recompute mode a stage may take: the step rewritten so, cut into layers, priced, its stage table."""

    mode: str
    lay: _Layered
    prices: LayerPrices
    stage_time: np.ndarray


def _variants(modes: StageModes | None, lay: _Layered, prices: LayerPrices, stage_time: np.ndarray, priced: Any,
              num_layers: int | None, forced: Sequence[int], num_microbatches: int, link: np.ndarray,
              ) -> list[_Variant]:
    """The recompute modes the stage DP chooses among per stage: those of ``modes`` whose rewrite cuts into the
    same layers as ``lay`` (the last mode's graph), each priced (``priced``: memoised on its graph, so a mode
    planned alone before costs nothing again), cheapest first; without ``modes``, ``lay`` alone."""
    own = _Variant("" if modes is None else modes.graphs[-1][0], lay, prices, stage_time)
    if modes is None:
        return [own]
    out = []
    for mode, g in modes.graphs[:-1]:
        other = _layered(g, split_step(g), num_layers, forced)
        if not _same_layers(other, lay):
            log.info("recompute %s cuts into other layers; not a per-stage option", mode)
            continue
        p = priced(other)
        out.append(_Variant(mode, other, p, _stage_times(p.micro_time + p.update_time / num_microbatches,
                                                         other.into, link)))
    return [*out, own]


def _per_stage_recompute(modes: StageModes, lay: _Layered, chosen: Sequence[tuple[int, int, int]],
                         stage_modes: Sequence[str]) -> tuple[dict[str, str], Graph]:
    """The recompute config (block -> mode) of stages ``chosen`` in ``stage_modes``, and the step rewritten
    so (``modes.graph_of``): a block takes its stage's mode (a block cut across stages, the largest)."""
    order = {m: k for k, m in enumerate(REMAT_MODES)}
    mode_of: dict[str, str] = {}
    for (first, last, _), mode in zip(chosen, stage_modes, strict=True):
        for ell in range(first, last + 1):
            for b in lay.blocks[ell]:
                if order[mode] > order[mode_of.get(b, "none")]:
                    mode_of[b] = mode
    config = {b: mode_of.get(b, "none") for b in modes.blocks}
    if not any(m != "none" for m in config.values()):
        config = {}
    return config, modes.graph_of(config)


class _ComposedMemory:
    """Bytes per device a stage of layers ``first..last`` on option ``m`` holds with ``held`` microbatches
    in flight when its layers' own plans are joined (``assignment_of_layers``): the update part's peak
    plus the microbatch part's (activations counted ``held`` times), as ``plan_part`` plans them. The
    stage DP adds per-layer memory, which leaves out what joining adds (a value crossing between layers
    in two layouts, temporaries of neighbouring layers live together); this is the whole stage's own
    memory model, at the cost of building its problem (cached per identical stage, and kept for the
    stage's whole solve; ``forget`` drops it for a stage struck from the cut)."""

    def __init__(self, graph: Graph, prices: Any, micro_ops: Sequence[Sequence[int]],
                 update_ops: Sequence[Sequence[int]], costs: Sequence[Any], microbatches: int) -> None:
        self.graph, self.prices, self.micro_ops, self.update_ops = graph, prices, micro_ops, update_ops
        self.costs, self.microbatches = costs, microbatches
        self.cache: dict[Any, float] = {}

    def forget(self, first: int, last: int) -> None:
        """Drop the problems built for layers ``first..last`` (a stage no longer chosen: they are large)."""
        for per_layer in (self.micro_ops, self.update_ops):
            ops = [i for ell in range(first, last + 1) for i in per_layer[ell]]
            if ops:
                subgraph(self.graph, ops).graph.memo(PROBLEMS).clear()

    def __call__(self, first: int, last: int, m: int, held: int) -> float:
        ells = range(first, last + 1)
        mops = [i for ell in ells for i in self.micro_ops[ell]]
        uops = [i for ell in ells for i in self.update_ops[ell]]
        key = (signature(self.graph, mops) + signature(self.graph, uops), m, held)
        if key not in self.cache:
            total = 0.0
            parts = [self.prices.parts[ell][m] for ell in ells]
            for ops, plans, per_layer, weight, per_call in (
                    (uops, [p.update for p in parts], self.update_ops, 1.0, 1.0),
                    (mops, [p.micro for p in parts], self.micro_ops, float(held), 1.0 / max(1, self.microbatches))):
                if not ops:
                    continue
                start = assignment_of_layers(self.graph, plans, [per_layer[ell] for ell in ells], ops)
                sub = subgraph(self.graph, ops)
                # built into the stage's own problem cache: the stage, when chosen, is planned whole on that
                # very problem (``plan_part``, same weights), not built a second time (GPT-1.3B's two stages
                # on 1x4: 4 builds of 1-3 s each)
                built = ProblemCache.of(sub.graph).get(self.costs[m], None, weight, per_call)
                total += peak_memory_of(built, assignment_choice(built, start.layouts))
            self.cache[key] = total
        return self.cache[key]


def _layouts(submeshes: Sequence[tuple[int, int]]) -> tuple[tuple[tuple[int, int], tuple[int, int] | None], ...]:
    """Each submesh shape with the logical layouts its stage may take (Alpa §5.2's logical mesh shapes):
    as it is (``None``), and a one-host shape ``(1, d)`` also as every 2-D ``(a, d/a)``, ``2 <= a <=
    d/2`` (e.g. 8 devices as 2x4: tensor parallel over 4 beside data parallel over 2, whose gradient
    reduction is paid once per step). Multi-host shapes are 2-D already (hosts x devices)."""
    out: list[tuple[tuple[int, int], tuple[int, int] | None]] = []
    for h, d in submeshes:
        out.append(((h, d), None))
        if h == 1:
            out += [((h, d), (a, d // a)) for a in range(2, d // 2 + 1) if d % a == 0]
    return tuple(out)


def _bytes_into_layers(graph: Graph, parts: Any, layer_of_op: Sequence[int], layers: int) -> np.ndarray:
    """``X(i)``: bytes of forward activations crossing into layer ``i`` from earlier layers."""
    fwd, _, cut = forward_sequence(graph, parts)
    into = np.zeros(layers)
    for k in range(1, len(fwd)):
        a, b = layer_of_op[fwd[k - 1]], layer_of_op[fwd[k]]
        if b != a:
            into[b] = cut[k - 1]
    return into


def _static_memory(prices: Any) -> np.ndarray:
    """``σ[i, j, m]``: the bytes a stage of layers ``i..j`` on option ``m`` holds whatever its microbatches in
    flight: its layers' update parts (parameters, gradients, optimizer state) and the largest of their
    microbatch passes' transients (``layer_prices.held_and_transient``: a stage runs one layer at a time)."""
    static = _range_sums(prices.update_memory)
    if prices.micro_transient is not None:
        static = static + _range_maxima(prices.micro_transient)
    return static


def _range_maxima(per_layer: np.ndarray) -> np.ndarray:
    """``out[i, j, m] = max_{ℓ=i..j} per_layer[ℓ, m]`` (0 where ``j < i``)."""
    layers, shapes = per_layer.shape
    out = np.zeros((layers, layers, shapes))
    for i in range(layers):
        out[i, i:] = np.maximum.accumulate(per_layer[i:], axis=0)
    return out


def _range_sums(per_layer: np.ndarray) -> np.ndarray:
    """``out[i, j, m] = Σ_{ℓ=i..j} per_layer[ℓ, m]`` (0 where ``j < i``; inf where a layer in range is)."""
    layers, shapes = per_layer.shape
    out = np.zeros((layers, layers, shapes))
    for i in range(layers):
        out[i, i:] = np.cumsum(per_layer[i:], axis=0)
    return out


def _refuse_hopeless_layers(prices: Any, submeshes: Sequence[tuple[int, int]], memory_budget: float | None,
                            inflight: Sequence[int]) -> None:
    """A layer that fits on no submesh even as a stage of its own (its plans infeasible under the whole
    budget on every shape) makes every pipeline infeasible: say so in the user's terms, not the DP's."""
    ok = np.isfinite(prices.micro_time) & np.isfinite(prices.update_time)
    hopeless = [ell for ell in range(ok.shape[0]) if not ok[ell].any()]
    if not hopeless:
        return
    largest = max(submeshes, key=lambda s: s[0] * s[1])
    where = "" if memory_budget is None else f" in {memory_budget / 1e9:.4g} GB per device"
    raise PipelineDoesNotFit(
        f"layer {hopeless[0]} of {ok.shape[0]} ({len(hopeless)} such layers) does not fit{where} on any submesh, "
        f"even as a stage of its own on {largest[0]}x{largest[1]} devices with {min(inflight)} microbatch(es) in "
        "flight; use more devices, more microbatches (smaller ones), or recompute")


def _stage_times(micro_time: np.ndarray, into: np.ndarray, link: np.ndarray) -> np.ndarray:
    """``t[i, j, m]``: the layers' time per microbatch plus receiving activations and sending cotangents
    (``link[m]``: bytes per second submesh ``m`` moves across a cut, all its devices' links together)."""
    t = _range_sums(micro_time) + (2 * into)[:, None, None] / link[None, None, :]
    layers = micro_time.shape[0]
    t[np.tril_indices(layers, -1)] = np.inf  # j < i is no stage
    t[~np.isfinite(t)] = np.inf
    return t


def _reused(graph: Graph, part: Part | None, micro_ops: Sequence[int], update_ops: Sequence[int]) -> Part | None:
    """An identical stage's plans carried over to these ops, or None."""
    if part is None:
        return None
    micro, update = reuse(graph, part.micro, micro_ops), reuse(graph, part.update, update_ops)
    return None if micro is None or update is None else Part(micro, update, 0)

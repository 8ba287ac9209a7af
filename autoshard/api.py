"""The public surface: ``autoshard.plan`` (pure planning on a logical mesh) and ``@autoshard.parallelize``
(trace, plan, emit and run on the devices present)."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from autoshard import cache as plan_cache
from autoshard import checkpoint, distributed, nnx_steps
from autoshard.emit import emit
from autoshard.emit.program import ArgumentMismatch, EmittedStep
from autoshard.errors import AutoshardError
from autoshard.options import PARALLELIZE_DEFAULTS, PLAN_DEFAULTS, PlanOptions
from autoshard.options import signature as options_signature
from autoshard.pipeline import (
    PipelinePlan,
    build_pipelined_step,
    explain_pipeline,
    plan_pipeline,
    trace_microbatch,
)
from autoshard.pipeline.microbatches import (
    INTERLEAVE_CHUNKS,
    derived_lockstep,
    derived_recompute,
    first_recompute,
    interleaved_lockstep,
    interleaving,
)
from autoshard.pipeline.microbatches import candidates as microbatch_candidates
from autoshard.pipeline.microbatches import search as search_microbatches
from autoshard.pipeline.partition import batch_rows
from autoshard.pipeline.pipeline_plan import cluster_of
from autoshard.pipeline.recompute import StageModes, plan_pipeline_recomputing
from autoshard.pipeline.report import one_stage_note
from autoshard.pipeline.spmd_program import SpmdPipelineStep, spmd_pipeline_step, tail_graph
from autoshard.planner.beside import Beside, can_fork
from autoshard.planner.deadline import Deadline
from autoshard.planner.explain import explain_plan
from autoshard.planner.plan import DoesNotFit, Plan, PlanError
from autoshard.planner.recompute import (
    RECOMPUTE_CHOICES,
    as_planned,
    describe,
    plan_recomputing,
    recomputed,
)
from autoshard.planner.shares import SHARES
from autoshard.planner.summary import human_time, with_input_classes
from autoshard.planner.utilization import model_flops
from autoshard.target import (
    SPMD_ONLY,
    MeshLike,
    PipelineOptions,
    PlanningError,
    Target,
    check_time_budget,
    parse_mesh,
    runs_spmd,
)
from autoshard.trace import Graph, trace
from autoshard.trace.recompute import estimate
from autoshard.trace.structure import block_labels
from autoshard.trace.summary import human_bytes
from autoshard.trace.unroll import unroll_layer_stacks

log = logging.getLogger("autoshard")

# an intra-operator plan whose peak is above this share of the budget was shaped by memory (``_cramped``)
CRAMPED = 0.9
# with no time budget given, an interleaved pipeline is also priced when the chosen one idles at least this
# share of its step (``_try_interleaving``)
INTERLEAVE_BUBBLE = 0.1


def plan(step_fn: Callable[..., Any] | Graph, *args: Any, options: PlanOptions | None = None,
         **kwargs: Any) -> Plan | PipelinePlan:
    """Plan ``step_fn(*args)`` on a logical mesh; no devices needed (args may be ShapeDtypeStructs, or
    ``step_fn`` a traced ``Graph`` and no args).

    The options are ``autoshard.PlanOptions``' fields, whose documentation says what each does: give them
    as ``options=PlanOptions(...)``, as keywords (``mesh="8x8", microbatches=8``), or both (the keywords
    replace those fields of ``options``). Here ``mesh`` defaults to ``(8,)`` and ``hardware`` to ``"h100"``
    (``options.PLAN_DEFAULTS``). The signature ``help`` and IDEs show lists the fields as keywords: it is
    built from ``PlanOptions`` (``options.signature``), where each is written once.

    The step is traced (progress to the ``"autoshard"`` logger at INFO), planned on the mesh as one
    intra-operator plan, and, with ``microbatches`` or when it does not fit unpipelined as traced, as a
    pipeline too; the faster plan is returned (a ``Plan`` or a ``PipelinePlan``).
    """
    opts = PlanOptions.of(options, **kwargs)
    target = opts.target(PLAN_DEFAULTS)
    return plan_for(step_fn, args, target, opts.pipeline_options(target), time_budget_s=opts.time_budget_s,
                    roles=opts.input_roles(), recompute=opts.recompute, unroll_scans=opts.unroll_scans)[0]


plan.__signature__ = options_signature(plan, PLAN_DEFAULTS)  # type: ignore[attr-defined]


def plan_for(step_fn: Callable[..., Any] | Graph, args: tuple[Any, ...], target: Target, options: PipelineOptions,
             *, time_budget_s: float | None, roles: Mapping[str, str] | None = None, recompute: str = "auto",
             traced: Graph | None = None, deadline: Deadline | None = None, unroll_scans: bool = True,
             ) -> tuple[Plan | PipelinePlan, Graph, Graph | None]:
    """``plan`` on a resolved target, also returning the traces it made: (plan, the graph it plans (the
    step's, rewritten when the plan recomputes), the microbatch-sized graph or None), so that
    ``parallelize`` emits from them instead of tracing again. ``traced``: ``step_fn`` already traced with
    ``args`` (``distributed.compile_everywhere`` traces it on every process first). ``deadline``: the one
    clock every phase reads (``planner.deadline``; default: ``time_budget_s`` from now on the wall clock;
    tests pass one on a fake clock). What a spent budget cut short is said in the log and in the plan's
    ``solver.cut_short``. ``unroll_scans`` (``PlanOptions.unroll_scans``): a traced step's layer stacks
    written as one scan are unrolled (``trace.unroll``) before anything is planned, and an intra-operator
    plan says so (``Plan.unrolled``); a ``Graph`` given is planned as it is."""
    check_time_budget(time_budget_s)
    if deadline is None:
        deadline = Deadline(time_budget_s)
    t0 = deadline.start
    assert t0 is not None
    if not isinstance(step_fn, Graph) and nnx_steps.holds_nnx(args):  # updates nnx objects in place
        call = nnx_steps.split(step_fn, args)
        step_fn, args = call.step, call.args
    if isinstance(step_fn, Graph) or traced is not None:
        graph = step_fn if isinstance(step_fn, Graph) else traced
    else:
        graph = trace(step_fn, *args, roles=roles)
    t_trace = None if isinstance(step_fn, Graph) else deadline.elapsed()
    if t_trace is not None and traced is None:
        log.info("traced the step: %d ops in %.1f s", len(graph.ops), t_trace)
    written = graph
    if unroll_scans and not isinstance(step_fn, Graph):
        graph = unroll_layer_stacks(graph, why="planned and emitted unrolled (unroll_scans=False keeps the scan)")
    unrolled = graph is not written
    # a plan cached by an earlier launch (``autoshard.cache``): checked against this trace, else planned
    key = plan_cache.key(graph, target, options, time_budget_s=time_budget_s, recompute=recompute,
                         name=getattr(step_fn, "__qualname__", type(step_fn).__name__))
    if (hit := plan_cache.lookup(key, step_fn, args, graph, roles)) is not None:
        return hit
    flops = model_flops(graph, target.cost.device)  # of the step as written (before any recompute)
    the_plan, planned, micro = _choose(step_fn, args, graph, deadline, t_trace, target, options,
                                       time_budget_s=time_budget_s, roles=roles, recompute=recompute)
    _warn_if_overrun(the_plan, time_budget_s, deadline.elapsed(), t_trace)
    the_plan = dataclasses.replace(the_plan, model_flops=flops)
    if isinstance(the_plan, Plan) and unrolled:
        the_plan = dataclasses.replace(the_plan, unrolled=True)
    if isinstance(the_plan, Plan):  # classes for its summary, from the step's blocks (``summary.input_class``)
        the_plan = with_input_classes(the_plan, block_labels(graph))
    if (note := deadline.note()) is not None:  # the summary says what the spent budget cut short
        the_plan = dataclasses.replace(the_plan, solver=dataclasses.replace(the_plan.solver, cut_short=note))
    plan_cache.store(key, the_plan)
    return the_plan, planned, micro


def _choose(step_fn: Callable[..., Any] | Graph, args: tuple[Any, ...], graph: Graph, deadline: Deadline,
            t_trace: float | None, target: Target, options: PipelineOptions, *, time_budget_s: float | None,
            roles: Mapping[str, str] | None, recompute: str) -> tuple[Plan | PipelinePlan, Graph, Graph | None]:
    """``plan_for`` after tracing: the intra-operator plan, pipelined plans, or both and the faster."""
    _warn_undivided_batch(graph, target)
    left = None if time_budget_s is None else max(time_budget_s - (t_trace or 0.0), SHARES.min_solve * time_budget_s)
    intra_s = left if left is None or not options.planned else SHARES.intra_with_pipeline * left
    cost, budget = target.cost, target.memory_budget
    as_traced = graph
    needs: dict[str, float] = {}  # per recompute mode, bytes per device the unpipelined step needs at least

    def need(mode: str) -> float:
        if mode not in needs:
            needs[mode] = estimate(as_traced, mode).peak_bytes / cost.mesh.num_devices
        return needs[mode]

    intra: Plan | None = None
    intra_error: Exception | None = None
    # no microbatch count given: a step cramped unpipelined (``_cramped``) is also pipelined, with a count the
    # planner picks (``pipeline.microbatches``), and the faster plan kept
    auto = options.microbatches is None and options.pipeline is not False and not isinstance(step_fn, Graph)
    # the step cannot fit as traced: an intra-operator plan fits only by recomputing, so it is cramped, and a
    # pipeline is planned too (both plans are certain)
    speculate = (auto and options.pipeline is None and recompute == "auto" and budget is not None
                 and need("none") > budget)
    if speculate and left is None:
        # the step cannot fit as traced, so an intra-operator plan fits only by recomputing, is cramped, and a
        # pipeline is planned too: the intra-operator plan gets the default budget whether it is made beside
        # the pipeline search (a core free) or before it, so that the plan does not depend on the machine's
        # load. A share of it made GPT-39B on 8x8 depend on it: at a one-minute load of 1.7 on two cores no
        # child is forked, the intra plan had 26 s (20 s of it building), its seeds stopped after ZeRO-3's
        # 510.6 s, and the pipeline won at 38.7% MFU; forked at a lower load, 42 s reach the tied seed's
        # 9.01 s (44.0%)
        intra_s = SHARES.auto_seconds(len(graph.ops))
    def settle(get: Callable[[], tuple[Plan, Graph]]) -> None:
        """The intra-operator plan and its graph from ``get``, or the error that keeps a pipeline the only way."""
        nonlocal intra, intra_error, graph
        try:
            intra, graph = get()
        except PlanError as e:
            if not options.planned and not auto:
                raise
            intra_error = e
        if intra is not None:
            intra = dataclasses.replace(intra, solver=dataclasses.replace(intra.solver, trace_seconds=t_trace))
            _warn_if_far_from_bound(intra, budget_given=time_budget_s is not None)

    def intra_plan() -> tuple[Plan, Graph]:
        if deadline.spent():
            deadline.cut("the intra-operator plan was solved in the solver's least time")
        return plan_recomputing(as_traced, cost, recompute=recompute, hardware=target.hardware,
                                memory_budget=budget, time_budget_s=intra_s, includes_build=True)

    pending: Beside[Plan] | None = None  # the intra-operator plan, made on another core beside the pipeline's
    deferred = False  # ``pending`` runs here after the pipeline search, only if time is left or no pipeline fits
    if not options.pipeline:
        both = speculate or (options.planned and options.pipeline is None)  # microbatches given: both planned
        if speculate and left is not None and deadline.spent(DEFER_BELOW * time_budget_s):
            # tracing took most of the user's budget: it cannot cover both a recomputing (so cramped)
            # intra-operator plan and the pipeline that is planned anyway; the pipeline goes first, and the
            # intra-operator plan gets what it leaves, or is planned only if no pipeline fits (GPT-1.3B on 2x4,
            # budget 5 s: its build alone took 6 s, and no recompute made it fit). Not forked even where a core
            # is free: the call would wait for the child's build (13 s there, beside the pipeline's 23 s on
            # two cores), where deferred it is not made once a pipeline is found
            deferred = True
            pending = Beside(lambda: intra_plan()[0], fork=False, what="intra-operator plan")
            log.info("%.1f s of the %.3g s time budget left after tracing: planning the pipeline first, the "
                     "intra-operator plan (which recomputes) after it if time is left", max(deadline.left() or 0.0, 0.0),
                     time_budget_s)
        elif both and len(graph.ops) >= BESIDE_MIN_OPS and not isinstance(step_fn, Graph) and can_fork():
            # both plans are certain (asked for, or the step cannot fit as traced, so the intra-operator plan
            # recomputes and is cramped) and independent until the faster is chosen: the intra-operator plan
            # is made in a forked process while this one plans the pipelines (GPT-39B on 8x8: ~45 s of each),
            # given the budget the search gets (no longer a share of one budget between them); with the
            # user's budget, both get what tracing left of it
            if left is not None:
                intra_s = left
            # a child stuck (on a lock another thread held at the fork) is stopped after twice its budget
            patience = 2 * (intra_s or SHARES.auto_seconds(len(graph.ops))) + 30
            pending = Beside(lambda: intra_plan()[0], fork=True, what="intra-operator plan", patience=patience)
            log.info("planning the intra-operator plan in process %s, beside the pipeline search",
                     pending.pid)
        else:
            settle(intra_plan)
    if not options.planned and intra is not None and not (auto and _cramped(intra, recompute, budget)):
        return intra, graph, None
    if isinstance(step_fn, Graph):
        raise PlanningError("a pipelined plan traces the step at microbatch size: pass the step function and "
                            "its arguments, not a Graph")
    pipe_s = None if left is None else max(time_budget_s - deadline.elapsed(), SHARES.min_solve * left)
    if left is not None and not options.planned and intra is not None:
        # a search the user did not ask for runs on what is left of their budget, never past it (GPT-1.3B at
        # seq 16384 on 1x8, budget 120 s: the intra plan returned at 102 s, and the pipelines it then tried,
        # none of which fit, ended at 167 s)
        pipe_s = time_budget_s - deadline.elapsed()
        if pipe_s < SHARES.min_solve * left:
            log.info("%.0f s of the %.0f s time budget left: too little to search for a pipeline "
                     "(microbatches= or --microbatches plans one); using the intra-operator plan",
                     max(pipe_s, 0.0), time_budget_s)
            deadline.cut("no pipeline was searched for beside the intra-operator plan, which memory shaped "
                         "(microbatches= or --microbatches plans one)")
            return intra, graph, None
    traced: dict[int, Graph] = {}  # id of a plan -> the microbatch graph it is a plan of

    def plan_one(count: int, seconds: float | None, interleaved: tuple[int, int] | None = None,
                 mode: str | None = None, derived: str = "interleaved-1f1b") -> PipelinePlan:
        """A pipeline of ``count`` microbatches as the options say, or, with ``interleaved`` (a stage shape),
        the pipeline of ``INTERLEAVE_CHUNKS`` chunks a stage on that shape that the ``derived`` schedule runs
        (interleaved 1F1B, or ZB-V; ``pipeline.microbatches.interleaving``). ``mode``: the recompute
        mode it is planned with alone (``derived_recompute``; ``invariant``, which no user can fix, starts
        ``"auto"`` there instead); None: ``recompute``, ``"auto"`` starting where ``first_recompute`` says."""
        t_in = deadline.elapsed()
        micro = trace_microbatch(step_fn, args, graph, count, roles=roles)
        if seconds is not None:  # tracing at microbatch size is part of the pipeline's seconds (GPT-15B: 9 s)
            seconds = max(seconds - (deadline.elapsed() - t_in), SHARES.min_solve * seconds)
        log.info("planning a pipeline of %d microbatches%s", count,
                 "" if interleaved is None else f", {derived} on stages of {interleaved[0]}x{interleaved[1]}")
        schedule, stage_shape, chunks = options.schedule, options.stage_shape, options.num_chunks
        if interleaved is not None:
            schedule, stage_shape, chunks = derived, interleaved, INTERLEAVE_CHUNKS

        def stages(g: Graph, s: float | None, modes: StageModes | None = None,
                   uniform: bool = options.uniform) -> PipelinePlan:
            return plan_pipeline(g, cost, hardware=target.hardware, memory_budget=budget, num_microbatches=count,
                                 schedule_name=schedule, num_layers=options.num_layers, time_budget_s=s,
                                 max_stages=options.max_stages, stage_shape=stage_shape, num_chunks=chunks,
                                 uniform=uniform, modes=modes, deadline=deadline)

        rec, start = recompute, "none"
        if mode is not None:
            rec, start = (mode, "none") if mode in RECOMPUTE_CHOICES else ("auto", mode)
            log.info("the pipeline of %d microbatches is planned %s, as the plan it is derived from",
                     count, describe(mode))
        elif recompute == "auto":
            start = first_recompute(need, cluster_of(cost.mesh)[0], count, budget)
            if start != "none":
                log.info("as traced, a stage's share of the step's activations would fill over half a "
                         "device (the step needs %.3g GB per device unpipelined): the pipeline of %d microbatches "
                         "is planned with %s recompute first", needs["none"] / 1e9, count, start)

        def hopeless(m: str) -> bool:
            """Whether no stage can hold the step as traced: in 1F1B's steady state every stage holds its
            layers' parameters and a microbatch's activations at least, so some device holds ``need / count``
            or more (GPT-1.3B at seq 16384 on 1x8, 8 microbatches: 109 GB a device)."""
            return m == "none" and budget is not None and need("none") / count > budget

        began = deadline.elapsed()
        the_plan, planned_graph = plan_pipeline_recomputing(micro, stages, recompute=rec, time_budget_s=seconds,
                                                            start=start, hopeless=hopeless)
        if options.spmd_if_faster and the_plan.host_time >= HOST_SHARE * the_plan.predicted_step_time:
            the_plan, planned_graph = _spmd_if_faster(
                the_plan, planned_graph, lambda s: plan_pipeline_recomputing(
                    micro, lambda g, t, m: stages(g, t, m, True), recompute=rec, time_budget_s=s, start=start,
                    hopeless=hopeless),
                None if seconds is None else _worth_a_plan(seconds - (deadline.elapsed() - began), seconds))
        traced[id(the_plan)] = planned_graph
        return the_plan

    def collect(have_pipeline: bool = False) -> None:
        """The intra-operator plan made beside, once the pipelines are searched: its graph is rewritten here
        with its recompute (``trace.remat`` again, pure: the graph the child planned). Deferred (``deferred``),
        it is planned now on what is left of the budget, or not at all when that is spent and a pipeline
        was found."""
        nonlocal intra_s
        if pending is None:
            return
        if deferred:
            if have_pipeline and deadline.spent():
                pending.cancel()
                deadline.cut("the intra-operator plan (recomputing) was not made beside the pipeline")
                return
            intra_s = max(deadline.left() or 0.0, SHARES.min_solve * (left or 0.0))
        settle(lambda: (p := pending.result(), recomputed(as_traced, p.recompute)))

    try:
        # made beside, the intra-operator plan recomputes when it exists (``speculate``): ``need("none")`` is
        # what ``_activations`` returns for it
        counts = ([options.microbatches] if options.microbatches else
                  microbatch_candidates(batch_rows(graph), cluster_of(cost.mesh)[0], budget=budget,
                                        activations=(need("none") if pending is not None else
                                                     _activations(need, intra, intra_error))))
        if not counts:
            collect()
            if intra is not None:
                return intra, graph, None
            assert intra_error is not None
            raise intra_error
        if pipe_s is None and len(counts) > 1:  # the search shares one budget, as one pipeline plan would have
            pipe_s = SHARES.auto_seconds(len(graph.ops))
        t_search = deadline.elapsed()
        piped, tried = search_microbatches(counts, plan_one, pipe_s, deadline.clock)
        if len(tried) < len(counts) and deadline.spent():
            deadline.cut("the microbatch count search stopped before " + ", ".join(
                str(c) for c in counts[len(tried):]) + " microbatches")
        if piped is not None and not options.microbatches:
            piped = _try_interleaving(piped, plan_one, batch_rows(graph), options,
                                      None if time_budget_s is None else pipe_s - (deadline.elapsed() - t_search),
                                      deadline.elapsed() - t_search, deadline)
    except BaseException:
        if pending is not None:
            pending.cancel()
        raise
    collect(have_pipeline=piped is not None)
    if piped is None:
        e: Exception = tried[-1][1] if tried else PlanningError("no time left to plan a pipeline")
        if not options.microbatches:
            e = PlanningError("no pipeline fits: " + "; ".join(f"{c} microbatches: {x}" for c, x in tried))
        if intra is not None and options.pipeline is None:
            log.warning("no pipelined plan (%s); using the intra-operator plan", e)
            return intra, graph, None
        if intra_error is not None:
            message = f"neither plan fits.\nintra-operator: {intra_error}\npipeline: {e}"
            if isinstance(intra_error, DoesNotFit):
                raise DoesNotFit(message, needed=intra_error.needed) from None
            raise PlanError(message) from None
        raise e
    if len(tried) > 1:
        log.info("microbatches chosen: %d (%s)", piped.num_microbatches,
                 ", ".join(f"{c}: {x.predicted_step_time:.3f} s" if isinstance(x, PipelinePlan) else f"{c}: no plan"
                           for c, x in tried))
    micro = traced[id(piped)]
    if intra is not None and options.pipeline is None and intra.predicted_step_time <= piped.predicted_step_time:
        solver = dataclasses.replace(intra.solver, pipeline_step_time=piped.predicted_step_time)
        return dataclasses.replace(intra, solver=solver), graph, micro
    if options.pipeline and (note := one_stage_note(piped)):
        log.warning("pipeline=True: %s", note)
    other: float | str | None = None
    if intra is not None:
        other = intra.predicted_step_time
    elif intra_error is not None:
        other = f"no plan: {str(intra_error).splitlines()[0]}"
    return dataclasses.replace(piped, solver=dataclasses.replace(piped.solver, intra_op_step_time=other)), graph, micro


# with a time budget, a step that cannot fit as traced plans its pipeline first when tracing left under this
# share of the budget (``_choose``)
DEFER_BELOW = 0.5
BESIDE_MIN_OPS = 5000  # a step with fewer ops plans its intra-operator plan first, in this process: forking costs
# more than it saves when each plan takes a few seconds
HOST_SHARE = 0.1  # an MPMD plan whose host work is this share of its step is also planned as the SPMD program


def _worth_a_plan(left: float, seconds: float) -> float:
    """``left`` of ``seconds``, or 0 when under ``SHARES.min_solve`` of them: too few to plan a pipeline
    without running past them (its layers' and stages' solves take a second each at least: GPT-15B on 1x8,
    the SPMD program's plan given the last 5 s of a 120 s budget took 26 s)."""
    return left if left >= SHARES.min_solve * seconds else 0.0


def _spmd_if_faster(mpmd: PipelinePlan, graph: Graph, plan_spmd: Callable[[float | None], tuple[PipelinePlan, Graph]],
                    seconds: float | None) -> tuple[PipelinePlan, Graph]:
    """``mpmd`` (a plan for the single-process MPMD runtime, whose host issues ``2·S·B`` programs and
    moves every value between stages itself: ``pipeline.host``) and the microbatch graph it plans, or the
    plan for the SPMD program (``plan_spmd``, one call a step, uniform stages) when that prices faster.
    ``seconds``: what is left of the count's planning time (None: each plan scales its own); with none
    left, the MPMD plan stands. A step with no uniform cut the program runs keeps the MPMD plan."""
    if seconds is not None and seconds <= 0:
        log.info("no time left to plan the SPMD program beside the MPMD runtime's plan, whose host "
                 "work is %s of its %s step", human_time(mpmd.host_time), human_time(mpmd.predicted_step_time))
        return mpmd, graph
    try:
        spmd, spmd_graph = plan_spmd(seconds)
    except AutoshardError as e:
        log.info("the MPMD runtime's plan stands (%s of host work in its %s step); the SPMD "
                 "program's: %s", human_time(mpmd.host_time), human_time(mpmd.predicted_step_time),
                 str(e).splitlines()[0])
        return mpmd, graph
    log.info("%d microbatches: the SPMD program %s a step, the MPMD runtime %s (%s of it the host "
             "issuing its programs)", mpmd.num_microbatches, human_time(spmd.predicted_step_time),
             human_time(mpmd.predicted_step_time), human_time(mpmd.host_time))
    return (spmd, spmd_graph) if spmd.predicted_step_time < mpmd.predicted_step_time else (mpmd, graph)


def _try_interleaving(piped: PipelinePlan, plan_one: Callable[..., PipelinePlan], batch: int,
                      options: PipelineOptions, left: float | None, took: float,
                      deadline: Deadline | None = None) -> PipelinePlan:
    """``piped`` (a pipeline whose microbatch count the planner chose), or the interleaved pipeline
    ``pipeline.microbatches.interleaving`` derives from it when that prices faster. Tried only when the
    schedule and the stages are the planner's to choose, and where it may pay for its own trace and
    pricing: with the user's time budget, when what is left of it is at least half of what the count
    search took; without one, when ``piped`` idles at least ``INTERLEAVE_BUBBLE`` of its step (GPT-1T,
    128 stages of 3x8 over 1024 microbatches: 19.0% under the SPMD program's ZB-H1 ticks). Uniform stages
    (the SPMD program's) are interleaved as the program runs them (``stages._uniform``, chunks of equal
    blocks, the tail spread where that pays), and there the derived stages are priced two ways, interleaved
    1F1B and ZB-V's two chunks in a V (whose ``F``, ``B`` and ``W`` each take about a forward, so its lockstep
    ticks lose little), the faster planned.

    The derived pipeline is planned with its base's recompute alone (``derived_recompute``): a lesser mode
    cannot fit where the base needed its own, and a greater one costs more compute than interleaving can
    buy back, at most the bubble it halves (GPT-1T under the default 72 GB budget: 64 stages of 6x8 over
    512 microbatches do not fit with selective recompute and price 117.1 s with full, against the base's
    84.4 s; planning that too took 26 s more). An SPMD plan's derived pipeline is first priced beside it
    from its own stage times (``interleaved_lockstep``), and not traced or planned when its ticks are no
    shorter (GPT-1T: 95.6 s of ticks against the base's 79.8 s; planned at an 80 GB budget, 100.9 s a step
    against 84.4 s, for 57 s more)."""
    if options.schedule != "auto" or options.stage_shape is not None or options.num_chunks != INTERLEAVE_CHUNKS:
        return piped
    if piped.schedule in SPMD_ONLY:  # the planner chose ZB-V's chunks in a V: interleaving derives from one a stage
        return piped
    if (piped.bubble_fraction < INTERLEAVE_BUBBLE) if left is None else (left < 0.5 * took):
        if left is not None and deadline is not None and piped.bubble_fraction >= INTERLEAVE_BUBBLE:
            deadline.cut(f"the interleaved variant of the pipeline (bubble {piped.bubble_fraction:.0%}) was not "
                         "priced")
        return piped
    found = interleaving([st.submesh for st in piped.stages], piped.num_microbatches, batch, piped.cluster,
                         piped.num_layers)
    if found is None:
        return piped
    count, shape = found
    name = "interleaved-1f1b"
    if piped.spmd:  # the SPMD program's lockstep ticks: priced from the base's stage times first, both ways
        # the derived stages are run (interleaved 1F1B and ZB-V's V), the faster kept
        ours, derived = interleaved_lockstep(piped, count, batch)
        # a V's stage holds two of the base's chunks, each with its weights and up to the base's first stage's
        # microbatches in flight: screened by twice the base's fullest stage before it is priced (GPT-1T on 64
        # stages of 6x8, selective recompute: 84.4 GiB where the base's 3x8 stages hold 51.8, over a 67 GiB
        # budget; its ticks priced 76.76 s to the base's 79.98 s, and pricing them took 3-5 s)
        if piped.memory_budget is None or 2 * piped.peak_memory <= piped.memory_budget:
            v_derived = derived_lockstep(piped, count, batch, "zb-v")
            if v_derived < derived:
                name, derived = "zb-v", v_derived
        else:
            log.info("ZB-V on %dx%d stages over %d microbatches not tried: its stages hold two of the %s plan's "
                     "chunks, and twice its fullest stage (%s) is over the memory budget", *shape, count,
                     piped.schedule, human_bytes(2 * piped.peak_memory))
        if derived >= ours:
            log.info("no interleaved pipeline of %d microbatches on %dx%d stages: priced from the %s "
                     "plan's stage times, its lockstep ticks take %s to its %s (exchanges left out)", count,
                     *shape, piped.schedule, human_time(derived), human_time(ours))
            return piped
        log.info("%s on %dx%d stages over %d microbatches: priced from the %s plan's stage times, its lockstep "
                 "ticks take %s to its %s (exchanges left out); planning it", name, *shape, count, piped.schedule,
                 human_time(derived), human_time(ours))
    try:
        # a base recomputing per stage (its first stages more) gives no one mode: ``recompute`` decides afresh
        mode = derived_recompute(piped.recompute) if len(set(piped.recompute.values())) < 2 else None
        other = plan_one(count, left, shape, mode, name)
    except AutoshardError as e:
        log.info("no %s pipeline of %d microbatches on %dx%d stages (%s)", name, count, *shape,
                 str(e).splitlines()[0])
        return piped
    log.info("%s, %d microbatches on %dx%d stages: %s a step (%s: %s)", name, count, *shape,
             human_time(other.predicted_step_time), piped.schedule, human_time(piped.predicted_step_time))
    return other if other.predicted_step_time < piped.predicted_step_time else piped


FAR_FROM_BOUND = 10.0  # an unproven plan this many times its solver's lower bound gets a warning


def _warn_if_far_from_bound(plan: Plan, *, budget_given: bool = True) -> bool:
    """Warn (and say so) when the solve stopped at its time budget with a plan ``FAR_FROM_BOUND`` times its
    lower bound or more: the budget was too short for the problem (GPT-39B on 8x8 with 25 s, of which
    building took 16: a mix of layouts priced 656 s a step against a bound of 7.9 s; 9.2 s with the default
    budget). The bound can be weak (every op and edge at its own cheapest: a tiny GPT's plan is 2.4x its
    bound), so only a gross miss is flagged. ``budget_given``: whether the user gave the time budget; the
    advice to leave it out is for those who did."""
    s = plan.solver
    if s.optimal or not s.lower_bound or s.objective < FAR_FROM_BOUND * s.lower_bound:
        return False
    advice = ("Give it more time (time_budget_s=..., --time-budget), or leave the budget out to have it scaled "
              "to the problem." if budget_given else
              "The budget was the default, scaled to the problem; give it more (time_budget_s=..., "
              "--time-budget) to search further.")
    log.warning("the plan on %s predicts %s a step, %.0fx the solver's lower bound (%s): its time "
                "budget ran out (%.1f s of building, %.1f s of solving) before it could tell how good the plan is "
                "(the bound may be weak). %s", plan.mesh, human_time(plan.predicted_step_time),
                s.objective / s.lower_bound, human_time(s.lower_bound), s.build_seconds,
                s.seed_seconds + s.solve_seconds, advice)
    return True


OVERRUN = 1.5  # a call that took this many times its time budget (and 2 s more) says so


def _warn_if_overrun(plan: Plan | PipelinePlan, budget: float | None, took: float, t_trace: float | None) -> bool:
    """Say (and return) when planning ran well past the user's time budget: the budget was shorter than what
    any plan of the step needs (``autoshard plan examples/gpt.py --preset 1.3b --mesh 2x4 --time-budget 5``:
    24.7 s, the step does not fit as traced and its pipeline's least times, tracing at the microbatch size
    and a least time per layer solve, add up past the budget). The overrun itself is not cured here."""
    if budget is None or took <= OVERRUN * budget or took <= budget + 2.0:
        return False
    why = ("the step was planned as a pipeline, whose tracing at the microbatch size and least time per layer and "
           "stage solve add up past it" if isinstance(plan, PipelinePlan) else
           "building the solver's problem and its least solving time add up past it")
    log.warning("planning took %.1f s, %.1fx its %.3g s time budget (tracing %s): the budget is shorter than what "
                "a plan of this step needs: %s. Give it more time (time_budget_s=..., --time-budget), or leave it "
                "out to have it scaled to the step.", took, took / budget, budget,
                "none" if t_trace is None else f"{t_trace:.1f} s", why)
    return True


def _cramped(intra: Plan, recompute: str, budget: float | None) -> bool:
    """Whether an intra-operator plan was shaped by memory, so that microbatches (a pipeline holds one
    microbatch's activations at a time, a few in flight) may buy a faster plan: it fits only with the
    recompute ``recompute="auto"`` chose, or its peak is within ``CRAMPED`` of the budget (layouts chosen
    for memory, not time)."""
    if recompute == "auto" and intra.recompute:
        return True
    return budget is not None and intra.peak_memory > CRAMPED * budget


def _activations(need: Callable[[str], float], intra: Plan | None, intra_error: Exception | None) -> float | None:
    """Bytes per device the step as traced needs at least (the bound the failed intra-operator planning
    proved, every value split as far as the mesh's axes divide it, or, when that plan fits only by
    recomputing, ``need("none")``, the perfect-spread estimate ``_choose`` keeps), which sizes the
    pipeline's first microbatch count; None when the step fits as traced."""
    if intra_error is not None:
        return getattr(intra_error, "as_traced", None)
    if intra is not None and intra.recompute:
        return need("none")
    return None


def _warn_undivided_batch(graph: Graph, target: Target) -> None:
    """A batch whose rows no mesh axis divides cannot be split: every device would compute all of it."""
    if len(target.shape) == 1 and target.shape[0] == 1:
        return
    for tid in graph.inputs:
        t = graph.tensors[tid]
        if t.role.value != "batch" or not t.shape:
            continue
        rows = t.shape[0]
        if all(rows % n for n in target.shape if n > 1):
            sizes = sorted({n for n in target.shape if n > 1})
            log.warning("batch input %s has %d rows, which no mesh axis (sizes %s) divides: it cannot "
                        "be split by rows, so every device works on every row (split along another dimension, "
                        "such as a long sequence, at most). Use a batch size divisible by %s.",
                        t.name, rows, ", ".join(map(str, sizes)), " or ".join(map(str, sizes)))


def explain(plan: Plan | PipelinePlan) -> str:
    """A plan for a person: for an intra-operator plan the layouts per parameter class and per layer, the
    step time by category, memory by kind and where the time goes (``planner.explain``); for a pipelined
    plan its stages, submeshes and the time split into stage work, bubble and update."""
    if isinstance(plan, PipelinePlan):
        return explain_pipeline(plan)
    return explain_plan(plan).text()


def _device_mesh(mesh: MeshLike | None) -> jax.sharding.Mesh:
    """The devices a step runs on. A ``jax.sharding.Mesh`` keeps its devices and axis names (its axes made
    Auto, which sharding constraints need); a shape takes the first devices present (all of them on one
    axis when ``mesh`` is None)."""
    if isinstance(mesh, jax.sharding.Mesh):
        return jax.sharding.Mesh(mesh.devices, mesh.axis_names)
    if isinstance(mesh, jax.sharding.AbstractMesh):
        raise PlanningError("an AbstractMesh has no devices to run on: plan with autoshard.plan(mesh=...), or "
                            "pass parallelize a jax.sharding.Mesh (jax.make_mesh) or a shape such as (2, 4)")
    devices = jax.devices()
    shape, names = parse_mesh(mesh if mesh is not None else (len(devices),))
    n = int(np.prod(shape))
    if n > len(devices):
        raise PlanningError(
            f"mesh {'x'.join(map(str, shape))} needs {n} devices but {len(devices)} are present; plan for a "
            "larger cluster with autoshard.plan (no devices needed), or pick a smaller mesh"
        )
    return jax.sharding.Mesh(np.array(devices[:n]).reshape(shape), names)


def load_plan(path: str | Path) -> Plan | PipelinePlan:
    """A plan saved with ``plan.save(path)`` (or ``autoshard plan -o``), intra-operator or pipelined."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"{path}: cannot read a plan ({e})") from None
    if isinstance(data, dict) and data.get("kind") == "pipeline":
        try:
            return PipelinePlan.from_dict(data)
        except (KeyError, TypeError, ValueError) as e:  # PlanError included: name the file
            raise PlanError(f"{path}: not a pipeline plan that holds together ({type(e).__name__}: {e}); plan "
                            "again (autoshard plan ... -o FILE)") from None
    return Plan.load(path)


def _on_mesh(plan: Plan | PipelinePlan, mesh: jax.sharding.Mesh) -> Plan | PipelinePlan:
    """``plan`` ready to run on ``mesh``: as it is when the mesh has the plan's axes (names and sizes, in any
    order); when the mesh has the plan's shape under other names (``jax.make_mesh((2, 4), ("data", "model"))``
    for a plan on ``x=2, y=4``), with its axes matched by position (``Plan.with_axis_names``: the program is
    emitted with the mesh's names; a pipeline's stages name their own submeshes' axes, so it runs as it is).
    Refused when the shapes differ, or when the mesh uses one of the plan's axis names at another position
    (matching by position would then give that name another axis's meaning)."""
    have = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    want = dict(zip(plan.mesh.axis_names, plan.mesh.shape, strict=True))
    if have == want:
        return plan
    shape = tuple(plan.mesh.shape)
    hint = (f"pass mesh={shape} or a jax Mesh of shape {shape} (its axes are matched to the plan's by position), "
            "or plan again for this mesh")
    if tuple(mesh.devices.shape) != shape:
        raise PlanningError(f"the given plan was made for the mesh {want}, but this step runs on {have}: {hint}")
    moved = [a for i, a in enumerate(mesh.axis_names) if a in want and plan.mesh.axis_names[i] != a]
    if moved:
        raise PlanningError(
            f"the given plan was made for the mesh {want}, but this step runs on {have}: the shapes agree, but the "
            f"mesh names its axis {moved[0]!r} after another of the plan's axes, so matching the axes by position "
            f"would be ambiguous. Name the mesh's axes {tuple(plan.mesh.axis_names)} (or names the plan does not "
            "use), or plan again for this mesh")
    log.info("the plan's mesh axes %s run on the mesh's axes %s (matched by position)",
             ", ".join(plan.mesh.axis_names), ", ".join(mesh.axis_names))
    return plan.with_axis_names(mesh.axis_names) if isinstance(plan, Plan) else plan


def trace_for_plan(the_plan: Plan | PipelinePlan, fn: Callable[..., Any], args: tuple[Any, ...], *,
                   roles: Mapping[str | int, str] | None = None) -> tuple[Graph, Graph | None]:
    """The traces a saved plan runs (or is explained) on, checked against it (``verify``): for a ``Plan``
    the step's trace rewritten as the plan was planned (``as_planned``: unrolled, recomputing), and None;
    for a ``PipelinePlan`` the step's trace and the trace at microbatch size (``num_microbatches``) with the
    plan's recompute applied."""
    graph = trace(fn, *args, roles=roles)
    if isinstance(the_plan, Plan):
        graph = as_planned(graph, the_plan)
        the_plan.verify(graph)
        return graph, None
    micro = trace_microbatch(fn, args, graph, the_plan.num_microbatches, roles=roles)
    micro = recomputed(micro, the_plan.recompute)
    the_plan.verify(micro)
    return graph, micro


def _cache_key(leaves: list[Any], tree: Any) -> Any:
    """Arguments that compile to the same program get the same key: the pytree structure (``tree``, of the
    flat ``leaves``) and each leaf's shape and dtype as JAX sees it (a Python ``0`` and the int32 array a
    step returns for it are alike)."""
    # dtype objects, not strings: str(dtype) took ~25 us a leaf, milliseconds a step on GPT-sized trees
    return tree, tuple((x.shape, x.dtype) if hasattr(x, "dtype") else ((), _number_dtype(x)) for x in leaves)


_NUMBERS = (bool, int, float, complex)


def _number_dtype(x: Any) -> Any:
    """The dtype JAX gives a Python number; a TypeError for any other leaf without a dtype (a string, which
    ``jnp.result_type`` would read as a dtype name, a function, an arbitrary object): ``_not_an_array``."""
    if not isinstance(x, _NUMBERS):
        raise TypeError(f"{type(x).__name__} is not an array or a number")
    return jax.numpy.result_type(x)


def _not_an_array(fn: Callable[..., Any], args: tuple[Any, ...], error: TypeError) -> Exception:
    """The error for the first argument leaf of ``fn(*args)`` that is neither an array nor a Python number,
    named by its path (``batch.name``); ``error`` itself when every leaf is one."""
    from autoshard.errors import TraceError
    from autoshard.trace.roles import arg_names, leaf_name

    names = arg_names(fn, len(args))
    for path, x in jax.tree_util.tree_flatten_with_path(args)[0]:
        if hasattr(x, "dtype") or isinstance(x, _NUMBERS):
            continue
        name = leaf_name(names[path[0].idx], path[1:])
        shown = repr(x) if len(repr(x)) <= 40 else repr(x)[:37] + "..."
        return TraceError(
            f"argument {name} is a {type(x).__name__} ({shown}), not an array: a parallelized step's arguments "
            "must hold arrays (jax or numpy) or Python numbers as leaves. If it does not change between calls, "
            "make it static: a static field of its pytree (flax.struct.field(pytree_node=False), "
            "equinox.field(static=True)), or take it out of the arguments and close over it (a closure, or "
            "functools.partial(step, ...) over a parameter of its own), passing only arrays")
    return error


_MISS = object()  # parallelize._fast: no compiled program was found for the arguments


@dataclasses.dataclass(slots=True)
class _Compiled:
    graph: Graph  # for a pipelined plan: the trace at microbatch size
    plan: Plan | PipelinePlan
    step: Any
    fn: Callable[..., Any] | None = None  # the function compiled: the step, or an nnx step's pure form


class parallelize:  # lower case: used as a decorator, like jax.jit
    """Decorate a train step: the first call traces, plans and compiles it for the mesh; later calls with
    the same argument shapes reuse the compiled program. ``.plan`` is the latest plan, ``.explain()``
    prints it.

    The options are ``autoshard.plan``'s, ``autoshard.PlanOptions``' fields (``options=``, keywords, or both:
    the keywords replace those fields), and the signature lists them (``options.signature``). Here the
    defaults are the devices present (``options.PARALLELIZE_DEFAULTS``): ``mesh`` all of them on one axis,
    ``hardware="auto"`` their preset; a ``jax.sharding.Mesh`` (e.g. from ``jax.make_mesh``, or over a subset
    of the devices) runs on its own devices with its axis names. ``runtime`` also says how a pipelined plan
    runs (``PlanOptions.runtime``): it is planned for that runtime and runs on the one it was priced for
    (``target.runs_spmd``). ``plan=`` (a Plan, a PipelinePlan or the path of a saved one) runs that plan
    instead of planning; it must have been made for this step and this mesh's shape. A flax nnx step that
    updates the objects it is given (``optimizer.update(model, grads)``) runs as ``nnx.jit`` runs it
    (``autoshard.nnx_steps``).

        @autoshard.parallelize(mesh=(2, 4))
        def train_step(state, batch): ...
    """

    def __init__(self, fn: Callable[..., Any] | None = None, *, options: PlanOptions | None = None,
                 plan: Plan | PipelinePlan | str | Path | None = None, **kwargs: Any) -> None:
        # checked now; resolved at the first call: "auto" hardware and the default mesh look at the devices,
        # which must wait until the user has set up JAX (jax.distributed.initialize, platform flags)
        self.options = PlanOptions.of(options, **kwargs)
        self.fn = fn
        self.given_plan = load_plan(plan) if isinstance(plan, str | Path) else plan
        self._devices: jax.sharding.Mesh | None = None
        self._target: Target | None = None
        self.roles = self.options.input_roles()
        self._cache: dict[Any, _Compiled] = {}
        self._last: _Compiled | None = None
        self._functional: list[nnx_steps.Functional] = []  # the pure forms of an nnx step, one per graph

    def __call__(self, *args: Any) -> Any:
        if self.fn is None:  # used as @parallelize(...): the first call receives the function
            (fn,) = args
            self.fn = fn
            return self
        flat = None
        if self._last is None or self._last.fn is self.fn:  # (after an nnx call, no plain fast path to try)
            flat = jax.tree_util.tree_flatten(args)
            out = self._fast(self.fn, *flat)
            if out is not _MISS:
                return out
        if nnx_steps.holds_nnx(args):  # a flax nnx step updating its objects in place: run as nnx.jit does
            call = nnx_steps.split(self.fn, args, self._functional)
            if call.functional not in self._functional:
                self._functional.append(call.functional)
            return call.finish(self._run(call.step, call.args))
        return self._run(self.fn, args, flat)

    def _fast(self, fn: Callable[..., Any], leaves: list[Any], tree: Any) -> Any:
        """The steady state, a step fed its own last results: no signature built or hashed (~2 ms a call
        on GPT-350M's 879 leaves); the program's own trace-time check refuses other shapes. ``_MISS`` when
        the last program is not for these arguments."""
        last = self._last
        if (last is not None and last.fn is fn and isinstance(last.step, EmittedStep | SpmdPipelineStep)
                and tree == last.step.graph.in_tree):
            try:
                return last.step.call_flat(leaves)
            except (ArgumentMismatch, TypeError):  # a TypeError: a leaf that is no array, named by _run
                pass
        return _MISS

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], flat: tuple[list[Any], Any] | None = None) -> Any:
        """``fn(*args)`` by its compiled program, compiled at the first call with arguments like these;
        ``flat``: ``args`` flattened, when ``_fast`` has already tried them."""
        if flat is None:
            flat = jax.tree_util.tree_flatten(args)
            out = self._fast(fn, *flat)
            if out is not _MISS:
                return out
        try:
            key = _cache_key(*flat) if fn is self.fn else (fn, _cache_key(*flat))
        except TypeError as e:
            raise _not_an_array(fn, args, e) from None
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._compile(fn, args)
            self._cache[key] = compiled
        if compiled is not self._last:
            place = getattr(compiled.step, "place_state", None)
            if place is not None:
                # laid out (and copied) as the program wants them: the next call, fed this call's
                # results, then hits the same compiled program instead of compiling a second one for
                # arguments that are already on the devices; and a step switching back to an earlier
                # program brings arrays laid out by the other one, which jax.jit refuses as arguments
                args = place(*args)
        self._last = compiled
        return compiled.step(*args)

    @property
    def device_mesh(self) -> jax.sharding.Mesh:
        """The devices the step runs on, as a mesh with the plan's axis names."""
        if self._devices is None:
            self._devices = _device_mesh(self.options.mesh)
        return self._devices

    @property
    def target(self) -> Target:
        """The mesh, hardware and memory budget this step is planned for."""
        if self._target is None:
            mesh = self.device_mesh
            on_devices = dataclasses.replace(self.options, mesh=dict(zip(mesh.axis_names, mesh.devices.shape,
                                                                         strict=True)))
            self._target = on_devices.target(PARALLELIZE_DEFAULTS)
        return self._target

    def _compile(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> _Compiled:
        device_mesh = self.device_mesh
        multi = distributed.multiprocess()
        processes = jax.process_count() if multi else 1
        options = self.options.pipeline_options(self.target, processes)
        budget, recompute = self.options.time_budget_s, self.options.recompute
        if multi:  # planned on process 0, agreed by all: autoshard.distributed
            given = None if self.given_plan is None else _on_mesh(self.given_plan, device_mesh)
            return _Compiled(*distributed.compile_everywhere(
                fn, args, self.roles, options, device_mesh,
                lambda shapes, traced: plan_for(fn, shapes, self.target, options, time_budget_s=budget,
                                                roles=self.roles, recompute=recompute, traced=traced,
                                                unroll_scans=self.options.unroll_scans)[0],
                given), fn=fn)
        if self.given_plan is not None:
            the_plan, graph, micro = self._given(fn, args, device_mesh)
        else:
            the_plan, graph, micro = plan_for(fn, args, self.target, options, time_budget_s=budget,
                                              roles=self.roles, recompute=recompute,
                                              unroll_scans=self.options.unroll_scans)
        if isinstance(the_plan, Plan):  # tracing ran nothing: concrete args were fine
            return _Compiled(graph, the_plan, emit(graph, the_plan.specs, device_mesh), fn)
        assert micro is not None
        devices = list(device_mesh.devices.flat)
        if runs_spmd(self.options.runtime, the_plan.spmd, processes):  # a plan runs on the runtime it was priced for
            tail = tail_graph(fn, args, graph, the_plan, roles=self.roles)
            return _Compiled(micro, the_plan, spmd_pipeline_step(micro, graph, the_plan, devices, tail), fn)
        return _Compiled(micro, the_plan, build_pipelined_step(micro, the_plan, devices), fn)

    def _given(self, fn: Callable[..., Any], args: tuple[Any, ...],
               mesh: jax.sharding.Mesh) -> tuple[Plan | PipelinePlan, Graph, Graph | None]:
        """The user's plan checked against this step's trace and the devices, instead of planning."""
        assert self.given_plan is not None
        the_plan = _on_mesh(self.given_plan, mesh)
        graph, micro = trace_for_plan(the_plan, fn, args, roles=self.roles)
        return the_plan, graph, micro

    @property
    def plan(self) -> Plan | PipelinePlan:
        if self._last is None:
            raise PlanningError("no plan yet: call the decorated step once (it plans on its first call)")
        return self._last.plan

    @property
    def graph(self) -> Graph:
        if self._last is None:
            raise PlanningError("no graph yet: call the decorated step once")
        return self._last.graph

    def explain(self) -> str:
        return explain(self.plan)

    # -- checkpoints (``autoshard.checkpoint``) ------------------------------------------------------------

    def save(self, directory: str | Path, state: Any, step: int, *, keep: int | None = None) -> Path:
        """Save ``state`` (the step's train state, as its last call returned it) as step ``step`` under
        ``directory`` with orbax: each process writes the shards it holds. ``keep``: keep the newest only."""
        return checkpoint.save(directory, state, step, keep=keep)

    def restore(self, directory: str | Path, like: Any, *, step: int | None = None,
                args: tuple[Any, ...] | None = None, argnum: int = 0) -> Any:
        """The state saved under ``directory`` (step ``step``, default the newest), restored for this step's
        mesh and plan whatever mesh, plan or process count saved it. ``like``: the state's structure (arrays
        or ``jax.eval_shape`` of the initialiser). It comes back in the layout the step's program reads its
        argument ``argnum`` in: the program compiled for ``args`` (the step's arguments, ``like`` among them;
        planned now, or found in the plan cache) or, without ``args``, the last one called; before any
        program, evenly split over the mesh (``checkpoint.even_shardings``), and the first call lays it out."""
        if args is not None and self.fn is not None and not nnx_steps.holds_nnx(args):
            flat = jax.tree_util.tree_flatten(args)
            key = _cache_key(*flat)
            if key not in self._cache:
                self._cache[key] = self._compile(self.fn, args)
            program = self._cache[key]
        else:
            program = self._last
        shardings = None if program is None else checkpoint.state_shardings(program.step, like, argnum)
        if shardings is None:
            shardings = checkpoint.even_shardings(like, self.device_mesh)
        return checkpoint.restore(directory, like, step=step, shardings=shardings)


parallelize.__signature__ = options_signature(parallelize, PARALLELIZE_DEFAULTS)  # type: ignore[attr-defined]

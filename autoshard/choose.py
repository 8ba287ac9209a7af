"""Choosing a step's plan once it is traced (``api.plan_for``): the intra-operator plan, pipelines, or both and
the faster.

The choice is an enumeration in phases over one ``Choosing`` (the step, its trace, the target, the options and
the one clock), each phase a method:

1. ``start_intra``: the intra-operator plan of the step as traced, made here, in a forked process beside the
   pipeline search (both plans certain and the step large), or deferred after it (tracing spent most of the
   user's budget on a step that cannot fit as traced);
2. ``wants_pipeline`` / ``pipeline_seconds``: whether pipelines are searched at all (asked for with
   ``microbatches`` or ``pipeline=True``, or the intra-operator plan was shaped by memory, ``cramped``) and on
   what time;
3. ``search``: the microbatch counts (``pipeline.microbatches.candidates``), each planned by ``plan_one``, whose
   cut, schedule and recompute ``plan_pipeline_recomputing`` chooses and whose runtime ``spmd_if_faster`` does
   (MPMD or the SPMD program: ``runtime="auto"`` is that one filter, ``target.runtime_options``); the fastest
   count kept (``pipeline.microbatches.search``), then the interleaved or V schedule derived from it
   (``try_interleaving``);
4. ``decide``: the faster of the intra-operator plan and the pipeline, or the error that says why neither is.

Every candidate is priced by the pipeline's simulator (``solvers.pipeline.simulate``, through the plans) or
the intra-operator ILP's objective; nothing here prices a plan itself.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.pipeline import PipelinePlan, plan_pipeline, trace_microbatch
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
from autoshard.planner.beside import Beside, can_fork
from autoshard.planner.deadline import Deadline
from autoshard.planner.plan import DoesNotFit, Plan, PlanError
from autoshard.planner.recompute import RECOMPUTE_CHOICES, describe, plan_recomputing, recomputed
from autoshard.planner.shares import SHARES
from autoshard.planner.summary import human_time
from autoshard.target import SPMD_ONLY, PipelineOptions, PlanningError, Target
from autoshard.trace import Graph
from autoshard.trace.recompute import estimate
from autoshard.trace.summary import human_bytes

log = logging.getLogger("autoshard")

# an intra-operator plan whose peak is above this share of the budget was shaped by memory (``cramped``)
CRAMPED = 0.9
# with no time budget given, an interleaved pipeline is also priced when the chosen one idles at least this
# share of its step (``try_interleaving``)
INTERLEAVE_BUBBLE = 0.1
# with a time budget, a step that cannot fit as traced plans its pipeline first when tracing left under this
# share of the budget (``Choosing.start_intra``)
DEFER_BELOW = 0.5
BESIDE_MIN_OPS = 5000  # a step with fewer ops plans its intra-operator plan first, in this process: forking costs
# more than it saves when each plan takes a few seconds
HOST_SHARE = 0.1  # an MPMD plan whose host work is this share of its step is also planned as the SPMD program

Chosen = tuple[Plan | PipelinePlan, Graph, Graph | None]  # the plan, the graph it plans, the microbatch graph


def choose(step_fn: Callable[..., Any] | Graph, args: tuple[Any, ...], graph: Graph, deadline: Deadline,
           t_trace: float | None, target: Target, options: PipelineOptions, *, time_budget_s: float | None,
           roles: Mapping[str, str] | None, recompute: str) -> Chosen:
    """``api.plan_for`` after tracing: the intra-operator plan, pipelined plans, or both and the faster (the
    phases: this module's docstring). Returns the plan, the graph it plans (the step's, rewritten when an
    intra-operator plan recomputes) and the microbatch-sized graph a pipeline plans (or None)."""
    warn_undivided_batch(graph, target)
    c = Choosing(step_fn, args, graph, deadline, t_trace, target, options, time_budget_s, roles, recompute)
    c.start_intra()
    if not c.wants_pipeline():
        assert c.intra is not None
        return c.intra, c.planned, None
    if isinstance(step_fn, Graph):
        raise PlanningError("a pipelined plan traces the step at microbatch size: pass the step function and "
                            "its arguments, not a Graph")
    go, pipe_s = c.pipeline_seconds()
    if not go:
        assert c.intra is not None
        return c.intra, c.planned, None
    try:
        found = c.search(pipe_s)
    except BaseException:
        if c.pending is not None:
            c.pending.cancel()
        raise
    if found is None:  # no microbatch count to try: the intra-operator plan, or why there is none
        if c.intra is not None:
            return c.intra, c.planned, None
        assert c.intra_error is not None
        raise c.intra_error
    piped, tried = found
    c.collect(have_pipeline=piped is not None)
    return c.decide(piped, tried)


@dataclasses.dataclass(eq=False)
class Choosing:
    """The state of one choice (``choose``): what it is given, the intra-operator plan (``intra``, the graph it
    plans ``planned``, or the error ``intra_error``), that plan when it is made elsewhere (``pending``, forked
    beside the search or ``deferred`` after it), and the microbatch graph of each pipeline planned
    (``traced``, by the plan's id)."""

    step_fn: Callable[..., Any] | Graph
    args: tuple[Any, ...]
    graph: Graph  # the step as traced
    deadline: Deadline
    t_trace: float | None
    target: Target
    options: PipelineOptions
    time_budget_s: float | None
    roles: Mapping[str, str] | None
    recompute: str
    intra: Plan | None = None
    intra_error: Exception | None = None
    pending: Beside[Plan] | None = None  # the intra-operator plan, made on another core beside the pipeline's
    deferred: bool = False  # ``pending`` runs here after the pipeline search, only if time is left or no pipeline fits
    planned: Graph = dataclasses.field(init=False)  # the graph the intra-operator plan plans (recomputed)
    left: float | None = dataclasses.field(init=False)  # what tracing left of the user's budget
    intra_s: float | None = dataclasses.field(init=False)  # the intra-operator plan's seconds
    auto: bool = dataclasses.field(init=False)
    speculate: bool = dataclasses.field(init=False)
    needs: dict[str, float] = dataclasses.field(init=False, default_factory=dict)
    traced: dict[int, Graph] = dataclasses.field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        budget_s, options = self.time_budget_s, self.options
        self.planned = self.graph
        self.left = (None if budget_s is None else
                     max(budget_s - (self.t_trace or 0.0), SHARES.min_solve * budget_s))
        self.intra_s = self.left if self.left is None or not options.planned else SHARES.intra_with_pipeline * self.left
        # no microbatch count given: a step cramped unpipelined (``cramped``) is also pipelined, with a count the
        # planner picks (``pipeline.microbatches``), and the faster plan kept
        self.auto = (options.microbatches is None and options.pipeline is not False
                     and not isinstance(self.step_fn, Graph))
        # the step cannot fit as traced: an intra-operator plan fits only by recomputing, so it is cramped, and
        # a pipeline is planned too (both plans are certain)
        budget = self.target.memory_budget
        self.speculate = (self.auto and options.pipeline is None and self.recompute == "auto" and budget is not None
                          and self.need("none") > budget)
        if self.speculate and self.left is None:
            # the intra-operator plan gets the default budget whether it is made beside the pipeline search (a
            # core free) or before it, so that the plan does not depend on the machine's load. A share of it
            # made GPT-39B on 8x8 depend on it: at a one-minute load of 1.7 on two cores no child is forked,
            # the intra plan had 26 s (20 s of it building), its seeds stopped after ZeRO-3's 510.6 s, and the
            # pipeline won at 38.7% MFU; forked at a lower load, 42 s reach the tied seed's 9.01 s (44.0%)
            self.intra_s = SHARES.auto_seconds(len(self.graph.ops))

    def need(self, mode: str) -> float:
        """Bytes per device the unpipelined step needs at least with recompute ``mode`` (every value spread
        over the mesh)."""
        if mode not in self.needs:
            self.needs[mode] = estimate(self.graph, mode).peak_bytes / self.target.cost.mesh.num_devices
        return self.needs[mode]

    # -- 1. the intra-operator plan

    def intra_plan(self) -> tuple[Plan, Graph]:
        if self.deadline.spent():
            self.deadline.cut("the intra-operator plan was solved in the solver's least time")
        return plan_recomputing(self.graph, self.target.cost, recompute=self.recompute,
                                hardware=self.target.hardware, memory_budget=self.target.memory_budget,
                                time_budget_s=self.intra_s, includes_build=True)

    def settle(self, get: Callable[[], tuple[Plan, Graph]]) -> None:
        """The intra-operator plan and its graph from ``get``, or the error that keeps a pipeline the only way."""
        try:
            self.intra, self.planned = get()
        except PlanError as e:
            if not self.options.planned and not self.auto:
                raise
            self.intra_error = e
        if self.intra is not None:
            self.intra = dataclasses.replace(self.intra, solver=dataclasses.replace(
                self.intra.solver, trace_seconds=self.t_trace))
            warn_if_far_from_bound(self.intra, budget_given=self.time_budget_s is not None)

    def start_intra(self) -> None:
        """Make the intra-operator plan here, or start it beside the pipeline search, or defer it after."""
        options, budget_s = self.options, self.time_budget_s
        if options.pipeline:
            return
        both = self.speculate or (options.planned and options.pipeline is None)  # microbatches given: both planned
        if self.speculate and budget_s is not None and self.deadline.spent(DEFER_BELOW * budget_s):
            # tracing took most of the user's budget: it cannot cover both a recomputing (so cramped)
            # intra-operator plan and the pipeline that is planned anyway; the pipeline goes first, and the
            # intra-operator plan gets what it leaves, or is planned only if no pipeline fits (GPT-1.3B on 2x4,
            # budget 5 s: its build alone took 6 s, and no recompute made it fit). Not forked even where a core
            # is free: the call would wait for the child's build (13 s there, beside the pipeline's 23 s on
            # two cores), where deferred it is not made once a pipeline is found
            self.deferred = True
            self.pending = Beside(lambda: self.intra_plan()[0], fork=False, what="intra-operator plan")
            log.info("%.1f s of the %.3g s time budget left after tracing: planning the pipeline first, the "
                     "intra-operator plan (which recomputes) after it if time is left",
                     max(self.deadline.left() or 0.0, 0.0), budget_s)
        elif (both and len(self.graph.ops) >= BESIDE_MIN_OPS and not isinstance(self.step_fn, Graph)
              and can_fork()):
            # both plans are certain (asked for, or the step cannot fit as traced, so the intra-operator plan
            # recomputes and is cramped) and independent until the faster is chosen: the intra-operator plan
            # is made in a forked process while this one plans the pipelines (GPT-39B on 8x8: ~45 s of each),
            # given the budget the search gets (no longer a share of one budget between them); with the
            # user's budget, both get what tracing left of it
            if self.left is not None:
                self.intra_s = self.left
            # a child stuck (on a lock another thread held at the fork) is stopped after twice its budget
            patience = 2 * (self.intra_s or SHARES.auto_seconds(len(self.graph.ops))) + 30
            self.pending = Beside(lambda: self.intra_plan()[0], fork=True, what="intra-operator plan",
                                  patience=patience)
            log.info("planning the intra-operator plan in process %s, beside the pipeline search", self.pending.pid)
        else:
            self.settle(self.intra_plan)

    def collect(self, have_pipeline: bool = False) -> None:
        """The intra-operator plan made beside, once the pipelines are searched: its graph is rewritten here
        with its recompute (``trace.remat`` again, pure: the graph the child planned). Deferred (``deferred``),
        it is planned now on what is left of the budget, or not at all when that is spent and a pipeline
        was found."""
        pending = self.pending
        if pending is None:
            return
        if self.deferred:
            if have_pipeline and self.deadline.spent():
                pending.cancel()
                self.deadline.cut("the intra-operator plan (recomputing) was not made beside the pipeline")
                return
            self.intra_s = max(self.deadline.left() or 0.0, SHARES.min_solve * (self.left or 0.0))
        self.settle(lambda: (p := pending.result(), recomputed(self.graph, p.recompute)))

    # -- 2. whether, and on what time, pipelines are searched

    def wants_pipeline(self) -> bool:
        """Whether pipelines are planned: asked for, or no intra-operator plan is in hand, or the one in hand
        was shaped by memory and no count was given (``cramped``)."""
        return (self.options.planned or self.intra is None
                or (self.auto and cramped(self.intra, self.recompute, self.target.memory_budget)))

    def pipeline_seconds(self) -> tuple[bool, float | None]:
        """Whether the pipeline search runs, and on how many seconds (None: scaled by each plan). It does not
        when a search the user did not ask for has too little of their budget left, the intra-operator plan
        standing."""
        left, budget_s = self.left, self.time_budget_s
        if left is None:
            return True, None
        assert budget_s is not None
        pipe_s = max(budget_s - self.deadline.elapsed(), SHARES.min_solve * left)
        if not self.options.planned and self.intra is not None:
            # a search the user did not ask for runs on what is left of their budget, never past it (GPT-1.3B at
            # seq 16384 on 1x8, budget 120 s: the intra plan returned at 102 s, and the pipelines it then tried,
            # none of which fit, ended at 167 s)
            pipe_s = budget_s - self.deadline.elapsed()
            if pipe_s < SHARES.min_solve * left:
                log.info("%.0f s of the %.0f s time budget left: too little to search for a pipeline "
                         "(microbatches= or --microbatches plans one); using the intra-operator plan",
                         max(pipe_s, 0.0), budget_s)
                self.deadline.cut("no pipeline was searched for beside the intra-operator plan, which memory "
                                  "shaped (microbatches= or --microbatches plans one)")
                return False, None
        return True, pipe_s

    # -- 3. the pipelines

    def plan_one(self, count: int, seconds: float | None, interleaved: tuple[int, int] | None = None,
                 mode: str | None = None, derived: str = "interleaved-1f1b") -> PipelinePlan:
        """A pipeline of ``count`` microbatches as the options say, or, with ``interleaved`` (a stage shape),
        the pipeline of ``INTERLEAVE_CHUNKS`` chunks a stage on that shape that the ``derived`` schedule runs
        (interleaved 1F1B, or ZB-V; ``pipeline.microbatches.interleaving``). ``mode``: the recompute
        mode it is planned with alone (``derived_recompute``; ``invariant``, which no user can fix, starts
        ``"auto"`` there instead); None: ``recompute``, ``"auto"`` starting where ``first_recompute`` says."""
        options, deadline, budget, cost = self.options, self.deadline, self.target.memory_budget, self.target.cost
        t_in = deadline.elapsed()
        micro = trace_microbatch(self.step_fn, self.args, self.graph, count, roles=self.roles)
        if seconds is not None:  # tracing at microbatch size is part of the pipeline's seconds (GPT-15B: 9 s)
            seconds = max(seconds - (deadline.elapsed() - t_in), SHARES.min_solve * seconds)
        log.info("planning a pipeline of %d microbatches%s", count,
                 "" if interleaved is None else f", {derived} on stages of {interleaved[0]}x{interleaved[1]}")
        schedule, stage_shape, chunks = options.schedule, options.stage_shape, options.num_chunks
        if interleaved is not None:
            schedule, stage_shape, chunks = derived, interleaved, INTERLEAVE_CHUNKS

        def stages(g: Graph, s: float | None, modes: StageModes | None = None,
                   uniform: bool = options.uniform) -> PipelinePlan:
            return plan_pipeline(g, cost, hardware=self.target.hardware, memory_budget=budget,
                                 num_microbatches=count, schedule_name=schedule, num_layers=options.num_layers,
                                 time_budget_s=s, max_stages=options.max_stages, stage_shape=stage_shape,
                                 num_chunks=chunks, uniform=uniform, modes=modes, deadline=deadline)

        rec, start = self.recompute, "none"
        if mode is not None:
            rec, start = (mode, "none") if mode in RECOMPUTE_CHOICES else ("auto", mode)
            log.info("the pipeline of %d microbatches is planned %s, as the plan it is derived from",
                     count, describe(mode))
        elif self.recompute == "auto":
            start = first_recompute(self.need, cluster_of(cost.mesh)[0], count, budget)
            if start != "none":
                log.info("as traced, a stage's share of the step's activations would fill over half a "
                         "device (the step needs %.3g GB per device unpipelined): the pipeline of %d microbatches "
                         "is planned with %s recompute first", self.needs["none"] / 1e9, count, start)

        def hopeless(m: str) -> bool:
            """Whether no stage can hold the step as traced: in 1F1B's steady state every stage holds its
            layers' parameters and a microbatch's activations at least, so some device holds ``need / count``
            or more (GPT-1.3B at seq 16384 on 1x8, 8 microbatches: 109 GB a device)."""
            return m == "none" and budget is not None and self.need("none") / count > budget

        began = deadline.elapsed()
        the_plan, planned_graph = plan_pipeline_recomputing(micro, stages, recompute=rec, time_budget_s=seconds,
                                                            start=start, hopeless=hopeless)
        if options.spmd_if_faster and the_plan.host_time >= HOST_SHARE * the_plan.predicted_step_time:
            the_plan, planned_graph = spmd_if_faster(
                the_plan, planned_graph, lambda s: plan_pipeline_recomputing(
                    micro, lambda g, t, m: stages(g, t, m, True), recompute=rec, time_budget_s=s, start=start,
                    hopeless=hopeless),
                None if seconds is None else worth_a_plan(seconds - (deadline.elapsed() - began), seconds))
        self.traced[id(the_plan)] = planned_graph
        return the_plan

    def search(self, pipe_s: float | None) -> tuple[PipelinePlan | None, list[tuple[int, Any]]] | None:
        """The fastest pipeline over the microbatch counts (and its derived interleaving), with every count
        tried and its plan or error; None when no count is worth trying (the intra-operator plan collected)."""
        options, deadline, budget = self.options, self.deadline, self.target.memory_budget
        # made beside, the intra-operator plan recomputes when it exists (``speculate``): ``need("none")`` is
        # what ``activations_bound`` returns for it
        rows = batch_rows(self.graph)
        counts = ([options.microbatches] if options.microbatches else
                  microbatch_candidates(rows, cluster_of(self.target.cost.mesh)[0], budget=budget,
                                        activations=(self.need("none") if self.pending is not None else
                                                     activations_bound(self.need, self.intra, self.intra_error))))
        if not counts:
            self.collect()
            return None
        if pipe_s is None and len(counts) > 1:  # the search shares one budget, as one pipeline plan would have
            pipe_s = SHARES.auto_seconds(len(self.graph.ops))
        t_search = deadline.elapsed()
        piped, tried = search_microbatches(counts, self.plan_one, pipe_s, deadline.clock)
        if len(tried) < len(counts) and deadline.spent():
            deadline.cut("the microbatch count search stopped before " + ", ".join(
                str(c) for c in counts[len(tried):]) + " microbatches")
        if piped is not None and not options.microbatches:
            piped = try_interleaving(piped, self.plan_one, rows, options,
                                     None if self.time_budget_s is None else
                                     pipe_s - (deadline.elapsed() - t_search),  # type: ignore[operator]
                                     deadline.elapsed() - t_search, deadline)
        return piped, tried

    # -- 4. the faster

    def decide(self, piped: PipelinePlan | None, tried: list[tuple[int, Any]]) -> Chosen:
        """The faster of the intra-operator plan and ``piped`` (the pipeline search's best), or the error that
        says why neither is, the search's ``tried`` counts named."""
        options, intra, intra_error = self.options, self.intra, self.intra_error
        if piped is None:
            e: Exception = tried[-1][1] if tried else PlanningError("no time left to plan a pipeline")
            if not options.microbatches:
                e = PlanningError("no pipeline fits: " + "; ".join(f"{c} microbatches: {x}" for c, x in tried))
            if intra is not None and options.pipeline is None:
                log.warning("no pipelined plan (%s); using the intra-operator plan", e)
                return intra, self.planned, None
            if intra_error is not None:
                message = f"neither plan fits.\nintra-operator: {intra_error}\npipeline: {e}"
                if isinstance(intra_error, DoesNotFit):
                    raise DoesNotFit(message, needed=intra_error.needed) from None
                raise PlanError(message) from None
            raise e
        if len(tried) > 1:
            log.info("microbatches chosen: %d (%s)", piped.num_microbatches, ", ".join(
                f"{c}: {x.predicted_step_time:.3f} s" if isinstance(x, PipelinePlan) else f"{c}: no plan"
                for c, x in tried))
        micro = self.traced[id(piped)]
        if intra is not None and options.pipeline is None and intra.predicted_step_time <= piped.predicted_step_time:
            solver = dataclasses.replace(intra.solver, pipeline_step_time=piped.predicted_step_time)
            return dataclasses.replace(intra, solver=solver), self.planned, micro
        if options.pipeline and (note := one_stage_note(piped)):
            log.warning("pipeline=True: %s", note)
        other: float | str | None = None
        if intra is not None:
            other = intra.predicted_step_time
        elif intra_error is not None:
            other = f"no plan: {str(intra_error).splitlines()[0]}"
        return (dataclasses.replace(piped, solver=dataclasses.replace(piped.solver, intra_op_step_time=other)),
                self.planned, micro)


def worth_a_plan(left: float, seconds: float) -> float:
    """``left`` of ``seconds``, or 0 when under ``SHARES.min_solve`` of them: too few to plan a pipeline
    without running past them (its layers' and stages' solves take a second each at least: GPT-15B on 1x8,
    the SPMD program's plan given the last 5 s of a 120 s budget took 26 s)."""
    return left if left >= SHARES.min_solve * seconds else 0.0



def spmd_if_faster(mpmd: PipelinePlan, graph: Graph, plan_spmd: Callable[[float | None], tuple[PipelinePlan, Graph]],
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



def try_interleaving(piped: PipelinePlan, plan_one: Callable[..., PipelinePlan], batch: int,
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


def warn_if_far_from_bound(plan: Plan, *, budget_given: bool = True) -> bool:
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



def cramped(intra: Plan, recompute: str, budget: float | None) -> bool:
    """Whether an intra-operator plan was shaped by memory, so that microbatches (a pipeline holds one
    microbatch's activations at a time, a few in flight) may buy a faster plan: it fits only with the
    recompute ``recompute="auto"`` chose, or its peak is within ``CRAMPED`` of the budget (layouts chosen
    for memory, not time)."""
    if recompute == "auto" and intra.recompute:
        return True
    return budget is not None and intra.peak_memory > CRAMPED * budget


def activations_bound(need: Callable[[str], float], intra: Plan | None, intra_error: Exception | None) -> float | None:
    """Bytes per device the step as traced needs at least (the bound the failed intra-operator planning
    proved, every value split as far as the mesh's axes divide it, or, when that plan fits only by
    recomputing, ``need("none")``, the perfect-spread estimate ``choose`` keeps), which sizes the
    pipeline's first microbatch count; None when the step fits as traced."""
    if intra_error is not None:
        return getattr(intra_error, "as_traced", None)
    if intra is not None and intra.recompute:
        return need("none")
    return None



def warn_undivided_batch(graph: Graph, target: Target) -> None:
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


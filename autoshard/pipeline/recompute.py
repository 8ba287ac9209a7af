"""Recompute in pipelines: the microbatch graph rewritten (``trace.remat``) before it is cut into stages.

A pipeline stage holds one microbatch's activations per microbatch in flight, so recompute buys memory
there as it does unpipelined. The rewrite is applied to the microbatch-sized trace as a whole; the
replayed ops carry their block's scope and the ``backward`` phase, so the partition puts each block's
replay in the backward program of the stage that holds the block, and every price (layer, stage, DP)
sees the extra forward work and the shorter live ranges.

``recompute`` as for intra-operator plans (``planner.recompute``): ``"none"``, ``"selective"``, ``"full"``
fix it; ``"auto"`` plans the pipeline as traced and recomputes only when no cut into stages fits
(``PipelineDoesNotFit``), keeping the first that fits of: ``invariant`` (each block makes its values that
do not depend on the batch, its bf16 weight casts and masks, again in its backward instead of holding
them once per microbatch in flight: ``trace.remat``; a cast's worth of work), selective, full. Where memory
does not bind, holding them is faster (GPT-39B's 1x8 stages: 69.3 ms a microbatch holding them, 70.5 ms
replaying them, with 9.7 GB a device held on stage 0). A mode that cannot fit
even a stage of its own on the largest submesh is found out by the planner's first pass over the layers
(``stages._refuse_hopeless_layers``), at the price of pricing them.

With ``auto``, a mode planned after cheaper ones (those that did not fit, and those ``start`` skips) is
planned with them as options per stage (``StageModes``; ``stages``' recompute per stage): the first stages,
holding the most microbatches in flight, recompute, and the last ones may keep their blocks as traced.
A fixed mode recomputes alike on every stage.

``auto`` may start further along (``start``, from ``microbatches.first_recompute``): where a stage's share of
the step's activations without recompute would fill most of a device, a plan as traced still fits, but
only with layouts chosen for memory and stages that hold few microbatches, and a plan with recompute is
faster (GPT-1T, 1024 microbatches on 384x8 A100: 169.8 s a step as traced, at 67.0 of 67.1 GiB; 137.6 s
with selective recompute, a block per 3-host stage). Planning both and keeping the faster would double
the pipeline's planning time, so the rule decides which is planned first.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

from autoshard.pipeline.partition import PipelineDoesNotFit
from autoshard.pipeline.pipeline_plan import PipelinePlan
from autoshard.planner.recompute import check_recompute, describe, recomputed
from autoshard.trace.graph import Graph
from autoshard.trace.remat import blocks, summary, uniform

log = logging.getLogger("autoshard")


def every_block(micro: Graph, mode: str) -> dict[str, str]:
    """The recompute config with every block of ``micro`` in ``mode`` (empty for ``none``: as traced)."""
    return {} if mode == "none" else uniform(micro, mode)


@dataclasses.dataclass(frozen=True, eq=False)
class StageModes:
    """The recompute modes each stage of one pipeline chooses among (``stages``' stage DP).

    ``plain``: the microbatch step as traced; ``graphs``: (mode, ``plain`` with every block in that mode),
    cheapest first, the graph being planned last; ``blocks``: ``plain``'s recomputable blocks."""

    plain: Graph
    graphs: tuple[tuple[str, Graph], ...]
    blocks: tuple[str, ...]
    _mixed: dict[tuple[tuple[str, str], ...], Graph] = dataclasses.field(default_factory=dict, repr=False)

    def config(self, mode: str) -> dict[str, str]:
        """Every block in ``mode`` (``every_block``)."""
        return every_block(self.plain, mode)

    def graph_of(self, config: Mapping[str, str]) -> Graph:
        """The step with a mode per block (``config``): one of ``graphs`` where every block has its mode,
        else the step rewritten (``planner.recompute.recomputed``, once per config)."""
        for mode, g in self.graphs:
            if dict(config) == self.config(mode):
                return g
        key = tuple(sorted(config.items()))
        if key not in self._mixed:
            self._mixed[key] = recomputed(self.plain, dict(config))
        return self._mixed[key]

    def planned(self) -> list[Graph]:
        """Every graph made or given here."""
        return [g for _, g in self.graphs] + list(self._mixed.values())


def plan_pipeline_recomputing(micro: Graph, plan: Callable[[Graph, float | None, StageModes | None], PipelinePlan],
                              *, recompute: str = "auto", time_budget_s: float | None = None, start: str = "none",
                              hopeless: Callable[[str], bool] | None = None) -> tuple[PipelinePlan, Graph]:
    """``plan(graph, seconds, modes)`` (a pipeline planner bound to its target) on ``micro`` with the recompute
    setting ``recompute`` (module docstring); with ``"auto"``, the modes from ``start`` on are tried, and a
    mode tried after others did not fit is planned with those as options per stage (``modes``); a mode
    ``start`` skips is no option where ``hopeless(mode)`` (no stage can hold it: pricing it is time lost).
    Returns the plan and the microbatch graph it is a plan of (rewritten when it recomputes)."""
    check_recompute(recompute)
    t0 = time.perf_counter()
    modes: tuple[str, ...] = ("none", "invariant", "selective", "full") if recompute == "auto" else (recompute,)
    skipped: tuple[str, ...] = ()
    if recompute == "auto":
        skipped, modes = modes[:modes.index(start)], modes[modes.index(start):]
    errors: list[tuple[str, PipelineDoesNotFit]] = []
    # the cheaper modes, each a per-stage option of those tried after it: the modes no pipeline fits in alone,
    # and those ``start`` skips (the stages holding fewest microbatches may hold them as traced)
    cheaper: list[tuple[str, Graph]] = []
    names: tuple[str, ...] | None = None
    made: list[Graph] = [micro]  # whose layer prices ``stages`` memoises for the modes planned after them
    offered: list[StageModes] = []
    for mode in skipped:
        if hopeless is not None and hopeless(mode):
            log.debug("recompute %s fits no pipeline stage: not a per-stage option", mode)
            continue
        graph = recomputed(micro, every_block(micro, mode), level=logging.DEBUG)
        if mode == "none" or graph is not micro:
            cheaper.append((mode, graph))
            made.append(graph)
    try:
        for n, mode in enumerate(modes):
            config = every_block(micro, mode)
            graph = recomputed(micro, config)
            made.append(graph)
            if mode == "invariant" and graph is micro:
                continue  # no block holds a batch-independent value (a float32 model casts nothing)
            if mode != "none" and graph is micro and recompute == "auto":
                break  # no block to recompute
            # what is left once the microbatch step is rewritten (charged to the budget)
            left = None if time_budget_s is None else max(time_budget_s - (time.perf_counter() - t0),
                                                          0.25 * time_budget_s / (len(modes) - n))
            per_stage = None
            if cheaper:  # a stage holding fewer microbatches in flight may fit in a cheaper mode
                names = tuple(blocks(micro)) if names is None else names
                per_stage = StageModes(micro, (*cheaper, (mode, graph)), names)
                offered.append(per_stage)
            try:
                the_plan = plan(graph, left, per_stage)
            except PipelineDoesNotFit as e:
                if recompute != "auto":
                    raise
                errors.append((mode, e))
                cheaper.append((mode, graph))
                log.info("no pipeline fits with recompute %s; trying more", mode)
                continue
            if per_stage is not None:
                graph = per_stage.graph_of(the_plan.recompute)
                config = dict(the_plan.recompute)
            elif config:
                the_plan = dataclasses.replace(the_plan, recompute=config)
            if config:
                log.info("recompute %s makes the pipeline fit", summary(config))
            return the_plan, graph
    finally:
        for g in [*made, *(g for o in offered for g in o.planned())]:
            g.memo("pipeline.stages.layer_prices").clear()
    if not errors:  # no mode was planned: the cheap ones fit no stage, and there is no block to recompute
        tried = [m for m in (*skipped, *modes) if m in ("none", "invariant")] or ["none"]
        raise PipelineDoesNotFit(
            f"no pipeline stage can hold its layers with recompute {' or '.join(map(describe, tried))}, and the step "
            "has no repeated blocks to recompute (autoshard finds blocks as a run of layers that compute the same "
            "thing on weights of their own, each reading the one before; none repeats here): give it a larger "
            "memory budget or more devices, more microbatches, or recompute inside the model (jax.checkpoint or "
            "flax's nn.remat around its layers)")
    if len(errors) == 1:
        raise errors[0][1]
    raise PipelineDoesNotFit("no pipeline fits, recompute or not: "
                             + "; ".join(f"{describe(m)}: {e}" for m, e in errors)) from None

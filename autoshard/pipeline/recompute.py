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
from collections.abc import Callable

from autoshard.pipeline.partition import PipelineDoesNotFit
from autoshard.pipeline.pipeline_plan import PipelinePlan
from autoshard.planner.recompute import check_recompute, describe, recomputed
from autoshard.trace.graph import Graph
from autoshard.trace.remat import uniform

log = logging.getLogger("autoshard")


def plan_pipeline_recomputing(micro: Graph, plan: Callable[[Graph, float | None], PipelinePlan], *,
                              recompute: str = "auto", time_budget_s: float | None = None, start: str = "none",
                              ) -> tuple[PipelinePlan, Graph]:
    """``plan(graph, seconds)`` (a pipeline planner bound to its target) on ``micro`` with the recompute
    setting ``recompute`` (module docstring); with ``"auto"``, the modes from ``start`` on are tried.
    Returns the plan and the microbatch graph it is a plan of (rewritten when it recomputes)."""
    check_recompute(recompute)
    t0 = time.perf_counter()
    modes: tuple[str, ...] = ("none", "invariant", "selective", "full") if recompute == "auto" else (recompute,)
    if recompute == "auto":
        modes = modes[modes.index(start):]
    errors: list[tuple[str, PipelineDoesNotFit]] = []
    for n, mode in enumerate(modes):
        config = uniform(micro, mode) if mode != "none" else {}
        graph = recomputed(micro, config)
        if mode == "invariant" and graph is micro:
            continue  # no block holds a batch-independent value (a float32 model casts nothing)
        if mode != "none" and graph is micro and recompute == "auto":
            break  # no block to recompute
        # what is left once the microbatch step is rewritten (charged to the budget)
        left = None if time_budget_s is None else max(time_budget_s - (time.perf_counter() - t0),
                                                      0.25 * time_budget_s / (len(modes) - n))
        try:
            the_plan = plan(graph, left)
        except PipelineDoesNotFit as e:
            if recompute != "auto":
                raise
            errors.append((mode, e))
            log.info("autoshard: no pipeline fits with recompute %s; trying more", mode)
            continue
        if config:
            log.info("autoshard: recompute %s on %d blocks makes the pipeline fit", mode, len(config))
            the_plan = dataclasses.replace(the_plan, recompute=config)
        return the_plan, graph
    assert errors
    if len(errors) == 1:
        raise errors[0][1]
    raise PipelineDoesNotFit("no pipeline fits, recompute or not: "
                             + "; ".join(f"{describe(m)}: {e}" for m, e in errors)) from None

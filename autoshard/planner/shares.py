"""How the planner spends a time budget: every fraction in one place.

``plan_graph(time_budget_s=T)`` gives the solver ``T`` seconds; with ``includes_build`` (as
``autoshard.plan`` calls it) ``T`` is wall time for building and solving, and what building took is taken
from it (the solver keeps at least ``min_solve`` of it). Of the solver's time, on a graph of at least ``seed_min_nodes`` solver nodes, ``seeds`` goes to the seed portfolio
(``planner.seeds``) and the remainder to the final solve, which starts from the best seed. With no
``T`` (None), ``T = auto_seconds(nodes)``: a few seconds for a small model, a minute for a large one.
``autoshard.plan`` takes tracing from the user's budget too, and when it plans both an intra-operator
plan and a pipeline, gives the intra-operator plan ``intra_with_pipeline`` of what is left. Of the seed budget, ``first_round`` goes to one short tied solve per starting layout and
the rest to re-solving the ``second_round`` best of them with their layouts unpinned; when a starting
layout of the grid would get under ``min_grid_seed_seconds`` that way, the grid is left out and its time
goes to the final solve (``plan_graph`` gives the final solve whatever the seeds did not use).

The pipeline planner (``pipeline.stages``) gives ``layer_pricing · T`` to pricing every distinct layer on
every submesh shape (two solves each: update ops, microbatched ops; at least ``min_layer_seconds``
each) and ``stage_plans · T`` to planning the chosen stages whole (two solves per distinct stage), at
least ``min_stage_seconds`` per solve.

The intra-op solver divides the time it is given among its own phases (presolve, local search, block
descent, windows, the ILP); those fractions are documented with it, in ``solvers.intra_op.solve``.
Measured on GPT-6.7B over 8x8 (30 s): the best layout's first-round seed costs 231 ms, its second-round
seed 225 ms, the final untied solve 222 ms.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Shares:
    seed_min_nodes: int = 500  # below this the final solve alone is as good (small cores are exact)
    seeds: float = 0.6  # of plan_graph's budget, for the seeds; the final solve gets the rest
    first_round: float = 0.6  # of the seed budget, one short solve per seed
    second_round: int = 2  # best first-round seeds solved again with their layouts unpinned
    min_seed_seconds: float = 0.05  # a seed given less is skipped
    min_start_seconds: float = 1.0  # a given start's solve (a repair, a hand layout completed) gets at least this
    min_grid_seed_seconds: float = 0.25  # the grid's seeds are left out when each would get less (``seeds``)
    layer_pricing: float = 0.4  # pipeline: of the budget, for the per-layer prices
    stage_plans: float = 0.6  # pipeline: for the chosen stages planned whole
    min_stage_seconds: float = 1.0  # pipeline: at least this per whole-stage solve
    min_layer_seconds: float = 0.25  # pipeline: at least this per layer solve (a few hundred nodes)
    min_solve: float = 0.25  # of the budget, the least the solver gets however long building took
    intra_with_pipeline: float = 0.3  # of what is left after tracing, when a pipeline is planned too
    seconds_per_node: float = 1 / 200  # auto budget: a 1.3B GPT's ~8k nodes get 40 s
    auto_min: float = 3.0  # auto budget bounds, seconds
    auto_max: float = 60.0

    def auto_seconds(self, nodes: int) -> float:
        """The time budget for a problem of ``nodes`` solver nodes when the user gives none."""
        return min(self.auto_max, max(self.auto_min, nodes * self.seconds_per_node))


SHARES = Shares()

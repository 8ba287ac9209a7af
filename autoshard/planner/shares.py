"""How the planner spends a time budget: every fraction in one place.

``plan_graph(time_budget_s=T)`` on a graph of at least ``seed_min_nodes`` solver nodes gives
``seeds · T`` to the seed portfolio (``planner.seeds``) and the rest to the final solve, which starts from
the best seed. Of the seed budget, ``first_round`` goes to one short tied solve per starting layout and
the rest to re-solving the ``second_round`` best of them with their layouts unpinned.

The pipeline planner (``pipeline.stages``) gives ``layer_pricing · T`` to pricing every distinct layer on
every submesh shape (two solves each: update ops, microbatched ops) and ``stage_plans · T`` to planning
the chosen stages whole (two solves per distinct stage), at least ``min_stage_seconds`` per solve.

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
    layer_pricing: float = 0.4  # pipeline: of the budget, for the per-layer prices
    stage_plans: float = 0.6  # pipeline: for the chosen stages planned whole
    min_stage_seconds: float = 1.0  # pipeline: at least this per whole-stage solve


SHARES = Shares()

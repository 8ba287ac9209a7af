"""The intra-operator sharding problem (Alpa §4, XLA auto-sharding) and its solver.

    from solvers import IntraOpProblem, solve_intra_op
    problem = IntraOpProblem(node_costs=[...], node_memory=[...], intervals=..., edges=..., edge_costs=[...],
                             memory_limit=16e9, node_names=[...])
    sol = solve_intra_op(problem, time_budget_s=60.0)   # never raises because time ran out
    sol.choice, sol.cost, sol.optimal, sol.lower_bound, sol.status, sol.stats

Modules, in the order a solve uses them:

* ``problem``: ``IntraOpProblem`` (plain data, ``verify()``) and ``InfeasibleError``;
* ``io_json``: the versioned JSON format (``save_problem`` / ``load_problem``, ``to_json`` / ``from_json``);
* ``presolve``: exact reductions (dominance, fixing, follow-merging, DP elimination of trees and chains);
* ``tree_dp``: forest DP with memory priced in, the start for large cores;
* ``local_search``: ICM moves that respect memory;
* ``ilp``: the ILP (the mathematics is in its docstring) through HiGHS, CBC as the fallback;
* ``rowgen``: the same ILP with its memory rows added as answers break them (cores with many rows);
* ``restrict``: the exact ILP over a few strategies per node, for cores too large for one ILP;
* ``trws``: Lagrangian search whose inner solver is message passing (TRW-S, compiled in ``_trws_kernel``),
  the first search for cores too large for one ILP when the budget allows;
* ``anneal``: simulated annealing (its loop compiled by numba in ``_anneal_kernel``) for cores too large
  for one ILP when the budget allows;
* ``lns``: exact re-solves of windows, for cores too large for one ILP;
* ``bound``: a Lagrangian lower bound (forests sharing the costs, memory priced) for large cores;
* ``watchdog``: big HiGHS solves in a child process killed at the deadline;
* ``solve``: ``solve_intra_op``, which chains the above under a time budget;
* ``solution``: ``IntraOpSolution`` (``verify(problem)``) and ``PresolveStats``;
* ``symmetry``: ``equivalence_classes``, the copies of repeated blocks (tied to one choice by
  ``solve_intra_op(ties=)``: the best uniform plan, a start for large problems);
* ``brute_force``: the exhaustive reference for tiny problems.
"""

from solvers.intra_op.brute_force import brute_force_intra_op
from solvers.intra_op.io_json import load_problem, save_problem
from solvers.intra_op.problem import InfeasibleError, IntraOpProblem
from solvers.intra_op.solution import IntraOpSolution, PresolveStats
from solvers.intra_op.solve import solve_intra_op
from solvers.intra_op.symmetry import equivalence_classes

__all__ = [
    "InfeasibleError",
    "IntraOpProblem",
    "IntraOpSolution",
    "PresolveStats",
    "brute_force_intra_op",
    "equivalence_classes",
    "load_problem",
    "save_problem",
    "solve_intra_op",
]

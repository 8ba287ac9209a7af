"""Pure combinatorial optimisation for autoshard: the intra-operator sharding ILP and the
inter-operator stage DP. Knows nothing of JAX; inputs are frozen dataclasses of numpy arrays.

Intra-operator sharding (``solvers.intra_op``): build an :class:`IntraOpProblem`, call
:func:`solve_intra_op` with a time budget, read :class:`IntraOpSolution`. The ILP's mathematics is in
``solvers/intra_op/ilp.py``; the exact reductions in ``solvers/intra_op/presolve.py``.

Inter-operator parallelism (``solvers.inter_op``): the stage/submesh DP and layer clustering.
"""

from solvers.intra_op import (
    InfeasibleError,
    IntraOpProblem,
    IntraOpSolution,
    PresolveStats,
    brute_force_intra_op,
    equivalence_classes,
    load_problem,
    save_problem,
    solve_intra_op,
)

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

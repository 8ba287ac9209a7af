"""The intra-operator sharding problem (Alpa §4, XLA auto-sharding) and its solver."""

from solvers.intra_op.brute_force import brute_force_intra_op
from solvers.intra_op.io_json import load_problem, save_problem
from solvers.intra_op.problem import InfeasibleError, IntraOpProblem
from solvers.intra_op.solution import IntraOpSolution, PresolveStats
from solvers.intra_op.solve import solve_intra_op

__all__ = [
    "InfeasibleError",
    "IntraOpProblem",
    "IntraOpSolution",
    "PresolveStats",
    "brute_force_intra_op",
    "load_problem",
    "save_problem",
    "solve_intra_op",
]

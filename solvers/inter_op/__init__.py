"""The inter-operator problem (Alpa §5, arXiv 2201.12023): pipeline stages, submeshes, layer clustering.

    from solvers.inter_op import InterOpProblem, solve_inter_op
    problem = InterOpProblem(num_layers=L, cluster=(hosts, devices_per_host), stage_time=t,   # [L, L, M]
                             static_memory=σ, activation_memory=α, memory_limit=40e9,
                             num_microbatches=B)                                         # 1F1B by default
    sol = solve_inter_op(problem)      # exact; raises InterOpInfeasibleError naming the binding constraint
    sol.stages, sol.cost, sol.placement, sol.stats

    from solvers.inter_op import ClusteringProblem, cluster_layers
    layers = cluster_layers(ClusteringProblem(flops=f, cut_bytes=c, num_layers=L, forced=markers))
    layers.boundaries, layers.layer_of(n), layers.balance_used

Modules:

* ``problem``: ``InterOpProblem`` (plain data, ``verify()``), ``alpa_submeshes``, the in-flight rules
  ``inflight_1f1b`` / ``inflight_gpipe``, ``InterOpInfeasibleError``;
* ``stage_dp``: ``solve_inter_op``, Alpa's DP with the t_max search (recurrence in its docstring);
* ``solution``: ``InterOpSolution`` (``verify(problem)``), ``Stage``, ``InterOpStats``;
* ``placement``: ``place_submeshes``, tiling the cluster with the chosen submesh shapes;
* ``linear_partition``: ``linear_partition``, the min-max cut of layers into contiguous groups (the
  interleaved schedule's virtual stages);
* ``clustering``: ``cluster_layers``, grouping a sequence of ops into ``L`` balanced layers with cheap cuts
  (Alpa §5.2 operator clustering);
* ``io_json``: the versioned JSON format of ``InterOpProblem``;
* ``brute_force``: exhaustive references for tiny problems.
"""

from solvers.inter_op.brute_force import brute_force_clustering, brute_force_inter_op
from solvers.inter_op.clustering import Clustering, ClusteringProblem, cluster_layers
from solvers.inter_op.linear_partition import PartitionInfeasibleError, linear_partition
from solvers.inter_op.placement import place_submeshes
from solvers.inter_op.problem import (
    InterOpInfeasibleError,
    InterOpProblem,
    alpa_submeshes,
    inflight_1f1b,
    inflight_gpipe,
)
from solvers.inter_op.solution import InterOpSolution, InterOpStats, Stage, pipeline_cost
from solvers.inter_op.stage_dp import solve_inter_op

__all__ = [
    "Clustering",
    "ClusteringProblem",
    "InterOpInfeasibleError",
    "InterOpProblem",
    "InterOpSolution",
    "InterOpStats",
    "PartitionInfeasibleError",
    "Stage",
    "alpa_submeshes",
    "brute_force_clustering",
    "brute_force_inter_op",
    "cluster_layers",
    "inflight_1f1b",
    "inflight_gpipe",
    "linear_partition",
    "pipeline_cost",
    "place_submeshes",
    "solve_inter_op",
]

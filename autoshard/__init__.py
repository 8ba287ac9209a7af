"""autoshard: a compiler-style auto-parallelizer for JAX.

The passes, in order: ``trace`` (train step -> Graph), strategies, problem building, planning,
emission, runtime. The public surface is deliberately small.
"""

from autoshard.api import parallelize, plan
from autoshard.pipeline.partition import pipeline_stage
from autoshard.planner.plan import Plan
from autoshard.trace import Graph, Op, Role, Tensor, TraceError, trace

__all__ = ["Graph", "Op", "Plan", "Role", "Tensor", "TraceError", "parallelize", "pipeline_stage", "plan", "trace"]
__version__ = "0.1.0"

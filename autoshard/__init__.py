"""autoshard: a compiler-style auto-parallelizer for JAX.

The passes, in order: ``trace`` (train step -> Graph), ``strategies``, ``planner`` (the intra-operator
problem, its solution, the Plan), ``emit`` (one sharded program), ``pipeline`` (stages, schedules, the
runtime). ``target`` says what a plan is made for; ``api`` ties the passes together. The public surface
is deliberately small.
"""

from autoshard import checkpoint
from autoshard._version import __version__
from autoshard.api import explain, parallelize, plan
from autoshard.cache import set_cache_dir
from autoshard.kernels import ring_attention, splittable
from autoshard.options import PlanOptions
from autoshard.pipeline.partition import pipeline_stage
from autoshard.pipeline.pipeline_plan import PipelinePlan
from autoshard.planner.plan import Plan
from autoshard.strategies.custom import register_rule
from autoshard.target import PipelineOptions, Target
from autoshard.trace import Graph, Op, Role, Tensor, TraceError, trace

__all__ = [
    "Graph",
    "Op",
    "PipelineOptions",
    "PipelinePlan",
    "Plan",
    "PlanOptions",
    "Role",
    "Target",
    "Tensor",
    "TraceError",
    "__version__",
    "checkpoint",
    "explain",
    "parallelize",
    "pipeline_stage",
    "plan",
    "register_rule",
    "ring_attention",
    "set_cache_dir",
    "splittable",
    "trace",
]

"""Pass 1: trace a train step into a Graph (ops, tensors, roles, flops, live intervals, nested bodies)."""

from autoshard.errors import TraceError
from autoshard.trace.graph import Graph, GraphError, Op, Role, Tensor
from autoshard.trace.tracer import trace

__all__ = ["Graph", "GraphError", "Op", "Role", "Tensor", "TraceError", "trace"]

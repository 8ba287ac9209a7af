"""Errors autoshard raises for the person reading them: each names the op or argument, what was
expected, and what to try."""


class AutoshardError(Exception):
    """Base of every error autoshard raises on purpose."""


class ExampleError(AutoshardError, ValueError):
    """A model file does not follow the examples/ convention, or a preset/override is wrong."""


class TraceError(AutoshardError, TypeError):
    """A train step could not be traced into a Graph (not a JAX function, bad example arguments)."""


class GraphError(AssertionError):
    """A Graph broke one of its invariants (raised by ``Graph.verify``): a bug in the tracer or a pass."""

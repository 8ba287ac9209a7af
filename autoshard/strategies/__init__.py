"""Pass 2: candidate shardings per op, from a registry of rules keyed by primitive.

Importing this package registers every rule module (elementwise, dot, reduce, layout, indexing, special,
custom: shard_map regions, custom_partitioning, custom kernels, reshard).
Control flow (scan, while, cond, remat) is not a rule: the problem builder plans the bodies.
"""

from autoshard.strategies import (  # noqa: F401 - registers rules
    custom,
    dot,
    elementwise,
    indexing,
    layout,
    reduce,
    special,
)
from autoshard.strategies.registry import (
    FALLBACK,
    RULES,
    Candidate,
    RuleContext,
    Strategy,
    enumerate_specs,
    register,
    strategies_for,
)

__all__ = ["FALLBACK", "RULES", "Candidate", "RuleContext", "Strategy", "enumerate_specs", "register", "strategies_for"]

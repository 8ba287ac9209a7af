"""Emission: a traced Graph plus a spec map becomes one sharded, jitted program.

``emit(graph, specs, mesh)`` returns an ``EmittedStep`` callable like the traced function; ``SpecMap`` and
``scope_key`` say which tensors get which ``ShardingSpec``, scope by scope (nested scan/while/cond/remat
bodies included); ``validate_specs`` is the check ``emit`` runs first.
"""

from autoshard.emit.program import EmittedStep, emit, global_rel_error
from autoshard.emit.specs import (
    EmitError,
    SpecMap,
    iter_scopes,
    named_sharding,
    partition_spec,
    resolve_scope,
    scope_key,
    validate_specs,
)

__all__ = [
    "EmitError",
    "EmittedStep",
    "SpecMap",
    "emit",
    "global_rel_error",
    "iter_scopes",
    "named_sharding",
    "partition_spec",
    "resolve_scope",
    "scope_key",
    "validate_specs",
]

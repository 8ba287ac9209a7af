"""Several processes (multi-controller JAX, ``jax.distributed``): one plan agreed by every process, and
global arrays assembled from what each process holds.

Under ``jax.distributed`` every process runs the same Python program and calls the decorated step with its
own arguments. ``@autoshard.parallelize`` then

1. sees the step at its *global* size: a batch leaf (``Role.BATCH``, read off the step's dataflow as the
   tracer reads it: a leaf the step only consumes) is this process's part of the batch, its rows stacked over the processes in process order;
   every other leaf (params, optimizer state, counters) is the whole value, the same in every process;
2. traces the step on every process (a deterministic pass: the tensor ids a plan names agree), plans on
   process 0 only (the planner's time-budgeted solver is not deterministic across processes) and
   broadcasts the plan as JSON to the others; every process then checks, with a collective, that it holds
   the same plan for the same graph (one SHA-256 digest each, gathered and compared);
3. turns each call's arguments into global ``jax.Array``\\ s laid out with the program's input shardings
   (``global_args``): batch parts with ``jax.make_array_from_process_local_data``, whole values with
   ``jax.make_array_from_callback``; arrays that are already global pass through (the previous step's
   results) or are moved to the wanted layout.

A pipelined plan (``microbatches=``) runs the same way, as one SPMD program over a stage axis
(``pipeline.spmd_program``): every process traces the step at its global size and at its global microbatch
size, and runs the one program; its stages must be uniform.

A process that dies must not leave the others waiting forever: ``initialize`` wraps
``jax.distributed.initialize`` with a bounded heartbeat, after which JAX's coordination service ends every
other process with an error that says a task died.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from autoshard.emit import EmittedStep, emit
from autoshard.errors import AutoshardError
from autoshard.pipeline.partition import trace_microbatch
from autoshard.pipeline.pipeline_plan import PipelinePlan
from autoshard.pipeline.spmd_program import SpmdPipelineStep, spmd_pipeline_step, tail_graph
from autoshard.planner.plan import Plan
from autoshard.planner.recompute import as_planned, recomputed
from autoshard.target import PipelineOptions
from autoshard.trace import Graph, Role, trace
from autoshard.trace.tracer import input_roles

log = logging.getLogger("autoshard")

HEARTBEAT_TIMEOUT_S = 30


class DistributedError(AutoshardError, RuntimeError):
    """The processes of a multi-process run disagree, or one of them failed."""


def multiprocess() -> bool:
    """True when this program is one of several JAX processes (``jax.distributed`` is initialized)."""
    return jax.process_count() > 1


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S, **kwargs: Any) -> None:
    """``jax.distributed.initialize`` with a bounded heartbeat: if a process dies, the others end with
    JAX's "another task died" error after about ``heartbeat_timeout_s`` seconds instead of waiting in a
    collective forever. Other keyword arguments go to ``jax.distributed.initialize``."""
    try:
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id, heartbeat_timeout_seconds=heartbeat_timeout_s,
                                   **kwargs)
    except TypeError:  # a jax without heartbeat_timeout_seconds: its own (longer) default applies
        log.warning("autoshard.distributed: this jax.distributed.initialize takes no heartbeat_timeout_seconds; "
                    "a dead process is noticed after JAX's default heartbeat timeout")
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id, **kwargs)


# ---- the step at its global size ------------------------------------------------------------------------


def batch_leaves(fn: Callable[..., Any], args: tuple[Any, ...],
                 roles: Mapping[str | int, Any] | None = None) -> list[bool]:
    """For each flattened argument leaf, whether it is the batch (``Role.BATCH`` as ``autoshard.trace`` reads
    roles off the step's dataflow, ``roles`` overrides included). The step is traced once, abstractly, at
    the shapes given (this process's rows of the batch)."""
    abstract = jax.tree.map(_abstract, args)
    return [r is Role.BATCH for r in input_roles(fn, *abstract, roles=roles)]


def local_leaves(fn: Callable[..., Any], args: tuple[Any, ...],
                 roles: Mapping[str | int, Any] | None = None) -> list[bool]:
    """For each flattened argument leaf, whether it is this process's part of the batch (a batch leaf,
    ``batch_leaves``, that is not already a global array) rather than a whole value."""
    return _local(batch_leaves(fn, args, roles), args)


def _local(batch: Sequence[bool], args: tuple[Any, ...]) -> list[bool]:
    """Of the batch leaves (``batch``, per flattened leaf of ``args``), those that are this process's rows:
    not already a global array (the previous step's results)."""
    return [b and not _is_global(x) for b, x in zip(batch, jax.tree_util.tree_leaves(args), strict=True)]


def _abstract(x: Any) -> Any:
    if isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    return x


def _is_global(x: Any) -> bool:
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def global_shapes(fn: Callable[..., Any], args: tuple[Any, ...],
                  roles: Mapping[str, Any] | None = None) -> tuple[Any, ...]:
    """``args`` as ``jax.ShapeDtypeStruct`` leaves at their global size: batch parts get ``rows × number of
    processes`` rows; whole values and global arrays keep their shapes."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    local = local_leaves(fn, args, roles)
    n = jax.process_count()
    out = []
    for x, is_local in zip(leaves, local, strict=True):
        shape, dtype = np.shape(x), jax.dtypes.canonicalize_dtype(x.dtype if hasattr(x, "dtype") else np.result_type(x))
        if is_local:
            if not shape:
                raise DistributedError(
                    "a batch leaf is a scalar, so it has no rows to split over the processes; give it a "
                    "leading batch dimension, or mark it as state with roles={'<path>': 'state'}")
            shape = (shape[0] * n, *shape[1:])
        out.append(jax.ShapeDtypeStruct(shape, dtype))
    return tuple(jax.tree_util.tree_unflatten(tree, out))


# ---- one plan for every process -------------------------------------------------------------------------


def _broadcast_bytes(payload: bytes | None) -> bytes:
    """Process 0's ``payload`` on every process (the others pass None)."""
    from jax.experimental import multihost_utils

    mine = np.frombuffer(payload or b"", dtype=np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.array([mine.size], dtype=np.int64))[0])
    buf = np.zeros(n, dtype=np.uint8)
    if jax.process_index() == 0:
        buf[:] = mine
    return np.asarray(multihost_utils.broadcast_one_to_all(buf)).astype(np.uint8).tobytes()


def graph_signature(graph: Graph) -> str:
    """What a plan's tensor ids depend on: the inputs' names, shapes and dtypes and the ops in order."""
    ins = [(graph.tensors[t].name, list(graph.tensors[t].shape), str(graph.tensors[t].dtype)) for t in graph.inputs]
    ops = [op.primitive for _, op in graph.walk()]
    return json.dumps({"inputs": ins, "ops": ops, "tensors": len(graph.tensors)})


def check_agreement(what: str, text: str) -> None:
    """Gather one SHA-256 digest of ``text`` from every process; raise ``DistributedError`` naming the
    processes whose digest differs from process 0's."""
    from jax.experimental import multihost_utils

    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), dtype=np.uint8)
    every = np.asarray(multihost_utils.process_allgather(digest)).reshape(jax.process_count(), -1)
    odd = [p for p in range(every.shape[0]) if not np.array_equal(every[p], every[0])]
    if odd:
        raise DistributedError(
            f"processes {odd} hold a different {what} than process 0 (SHA-256 digests differ); every process "
            "must run the same program on arguments of the same structure, shapes and dtypes (a batch part "
            "of the same size), with the same autoshard and jax versions")


def agreed_plan(graph: Graph, make: Callable[[], Plan | PipelinePlan]) -> Plan | PipelinePlan:
    """``make()`` run on process 0 only, its plan broadcast to every process as JSON, and checked: every
    process must have traced the same graph and must hold the same plan. An error on process 0 (no plan
    fits) is raised on every process."""
    check_agreement("traced step", graph_signature(graph))
    payload = None
    if jax.process_index() == 0:
        try:
            payload = json.dumps({"plan": make().to_dict()}).encode()
        except AutoshardError as e:  # every process raises it, instead of the others waiting for a plan
            payload = json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
    got = json.loads(_broadcast_bytes(payload))
    if "error" in got:
        raise DistributedError(f"process 0 could not plan the step: {got['error']}")
    data = got["plan"]
    # verified by the caller against the trace it runs: a pipeline's at microbatch size, an intra-operator
    # plan's rewritten as it was planned (``as_planned``)
    plan: Plan | PipelinePlan = (PipelinePlan.from_dict(data) if isinstance(data, dict) and data.get("kind") == "pipeline"
                                 else Plan.from_dict(data))
    check_agreement("plan", json.dumps(plan.to_dict(), sort_keys=True))
    return plan


# ---- arguments as global arrays -------------------------------------------------------------------------


def _rows_of_this_process(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> bool:
    """True when this process's devices together need exactly its own block of rows (``rows / processes``,
    in process order) and every column: then its batch part can be handed over as it is."""
    n, p = jax.process_count(), jax.process_index()
    want = [(p * (shape[0] // n), (p + 1) * (shape[0] // n)), *((0, d) for d in shape[1:])]
    lo = [d for _, d in want]
    hi = [0] * len(shape)
    for dev, idx in sharding.devices_indices_map(shape).items():
        if dev.process_index != p:
            continue
        for k, (sl, d) in enumerate(zip(idx, shape, strict=True)):
            start, stop, _ = sl.indices(d)
            lo[k], hi[k] = min(lo[k], start), max(hi[k], stop)
    return list(zip(lo, hi, strict=True)) == want


def _from_local_rows(x: Any, sharding: jax.sharding.NamedSharding, global_shape: tuple[int, ...]) -> jax.Array:
    local = np.asarray(x)
    if _rows_of_this_process(sharding, global_shape):
        return jax.make_array_from_process_local_data(sharding, local, global_shape)
    # the plan wants rows this process does not hold (a batch not split over the processes): stage the
    # parts with the rows split by process, then let XLA move them into the plan's layout
    devices = np.array(sharding.mesh.devices.flat).reshape(jax.process_count(), -1)
    staging = jax.sharding.NamedSharding(jax.sharding.Mesh(devices, ("process", "local")),
                                         jax.sharding.PartitionSpec("process"))
    staged = jax.make_array_from_process_local_data(staging, local, global_shape)
    return jax.jit(lambda a: a, out_shardings=sharding)(staged)


def _from_whole(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    whole = np.asarray(x)
    return jax.make_array_from_callback(whole.shape, sharding, lambda idx: whole[idx])


def global_args(step: EmittedStep | SpmdPipelineStep, local: Sequence[bool], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` (this process's view) as global arrays in ``step``'s input shardings: batch parts (where
    ``local`` is true) stacked over the processes, whole values split or replicated, global arrays kept
    (or moved, where their layout is not the program's)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    out = []
    for i, (x, is_local) in enumerate(zip(leaves, local, strict=True)):
        sharding = step.in_shardings[i]
        aval = step.graph.tensors[step.graph.inputs[i]]
        if _is_global(x):
            out.append(x if x.sharding == sharding else jax.device_put(x, sharding))
        elif is_local:
            out.append(_from_local_rows(x, sharding, tuple(aval.shape)))
        else:
            out.append(_from_whole(x, sharding))
    return tuple(jax.tree_util.tree_unflatten(tree, out))


class GlobalStep:
    """An ``EmittedStep`` (or an SPMD pipeline step) called with one process's view of the arguments: each
    call first makes them global arrays (``global_args``). ``emitted`` is the program itself."""

    def __init__(self, emitted: EmittedStep | SpmdPipelineStep) -> None:
        self.emitted = emitted
        graph = emitted.graph
        self.batch = [graph.tensors[t].role is Role.BATCH for t in graph.inputs]  # read once, not per call

    def globalize(self, *args: Any) -> tuple[Any, ...]:
        return global_args(self.emitted, _local(self.batch, args), args)

    def place_state(self, *args: Any) -> tuple[Any, ...]:
        return self.emitted.place_state(*self.globalize(*args))

    def __call__(self, *args: Any) -> Any:
        return self.emitted(*self.globalize(*args))


def compile_everywhere(fn: Callable[..., Any], args: tuple[Any, ...], roles: Mapping[str | int, Any] | None,
                       options: PipelineOptions, mesh: jax.sharding.Mesh,
                       make: Callable[[tuple[Any, ...], Graph], Plan | PipelinePlan],
                       given: Plan | PipelinePlan | None = None) -> tuple[Graph, Plan | PipelinePlan, GlobalStep]:
    """What ``parallelize`` compiles when several processes run: the step traced at its global size on
    every process, planned by ``make(global_args, that trace)`` on process 0 (``agreed_plan``; ``given``: the user's
    plan instead, checked on every process), emitted on ``mesh``. A pipelined plan runs as one SPMD program
    (``pipeline.spmd_program``): the stages must be uniform."""
    shapes = global_shapes(fn, args, roles)
    graph = trace(fn, *shapes, roles=roles)
    plan = given if given is not None else agreed_plan(graph, lambda: make(shapes, graph))
    if isinstance(plan, Plan):
        graph = as_planned(graph, plan)  # the plan's rewrites, applied alike on every process
        plan.verify(graph)
        return graph, plan, GlobalStep(emit(graph, plan.specs, mesh))
    micro = trace_microbatch(fn, shapes, graph, plan.num_microbatches, roles=roles)
    micro = recomputed(micro, plan.recompute)
    plan.verify(micro)
    tail = tail_graph(fn, shapes, graph, plan, roles=roles)
    step = spmd_pipeline_step(micro, graph, plan, list(mesh.devices.flat), tail)
    return graph, plan, GlobalStep(step)

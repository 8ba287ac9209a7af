"""What the single-process MPMD runtime (``pipeline.runtime``) costs the host each step, counted and priced.

That runtime walks the schedule from Python. For every action ``(virtual stage u, microbatch m, kind)`` it
fetches each input of ``u``'s program of that kind and puts it onto the stage's submesh (``jax.device_put``)
unless it is already laid out as the program reads it: a stage's own residuals and the parameters go as
they are; the microbatch's slice of a batch input and a value from another stage are put. It calls the
program and adds each accumulated output (a gradient, the loss) into its running sum, one eager add per
output and microbatch after the first. Once a step it slices the batch inputs into microbatches, reduces
the accumulators (one program per stage), averages the others, and calls the update programs.

JAX dispatches asynchronously, so the host runs ahead of the devices; the devices can start an action no
sooner than the host has issued it. With ``c`` the host seconds to issue a program call or an eager op, ``a``
of each further argument of a call and ``p`` of a ``device_put`` (``HostCosts``, measured by ``autoshard
profile``), and ``moved(u, kind)`` the inputs made on another stage or sliced from the batch:

    host = B · Σ_u Σ_kind [ c + a·(n_in − 1) + p·moved ](u, kind) + (B − 1) · c · Σ acc(u, kind)
           + Σ_updates [ c + a·(n_in − 1) + p·moved ] + p·placed + c·(B·batch inputs + reductions + means)

where ``placed`` counts the parameters each stage reads, put once a step where the update left them in
another layout (an upper bound).

and ``solvers.pipeline.simulate`` prices the step with the host as one more serial resource, ``max(pipeline, host) +
update`` (``Costs.host``): a host slower than the stages' work leaves the devices waiting on it. The SPMD program (``spmd_program``) pays one call a step.

Pure: counts come from the step's graph and the stages' op assignment, as ``partition.segments`` groups
them for the runtime; nothing here runs JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from autoshard.pipeline.partition import UPDATE, StepParts, segments
from autoshard.pipeline.ticks import DISPATCH_S
from autoshard.trace.graph import Graph

# host seconds where no profile measured them (``autoshard profile``): each argument of a call, and a device_put
# of a small array onto other devices; the idle 2-core VM's (0.45 us and 144 us, against 99 us a call, the
# shipped CPU profile) scaled to ``DISPATCH_S`` a call, a host about twice as fast
ARG_S = 3e-7
PUT_S = 7e-5


@dataclasses.dataclass(frozen=True, slots=True)
class HostCosts:
    """Host seconds to issue the runtime's unit operations (module docstring)."""

    call: float = DISPATCH_S  # a program call (or an eager op) of one argument
    arg: float = ARG_S  # each further argument of a call
    put: float = PUT_S  # one jax.device_put of an array onto another stage's devices

    @classmethod
    def of(cls, profile: Any) -> HostCosts:
        """The costs ``profile`` (a ``cost_models.Profile``, or None) measured; defaults where it did not."""
        host = getattr(profile, "host", None) or {}
        default = cls()
        return cls(**{f.name: float(host.get(f.name) or getattr(default, f.name))
                      for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True, slots=True)
class HostWork:
    """What the MPMD runtime's host does in one step of a pipeline: ``programs`` stage programs called,
    ``calls`` calls and eager ops in all, ``args`` arguments passed, ``puts`` device_puts, and the
    ``seconds`` they take (``HostCosts``)."""

    programs: int
    calls: int
    args: int
    puts: int
    seconds: float


def host_work(graph: Graph, parts: StepParts, stage_of_op: Sequence[int], num_stages: int, num_microbatches: int,
              *, weight_pass: bool, costs: HostCosts) -> HostWork:
    """Count and price the MPMD runtime's host work for one step of ``graph`` (the step traced at microbatch
    size) cut into stages by ``stage_of_op`` (virtual stages, as ``PipelinePlan.stage_of_op``; virtual stage
    ``u`` runs on physical stage ``u mod num_stages``), with ``num_microbatches`` microbatches and backwards
    split for a weight pass (ZB-H1) or not. A value made on the stage that reads it is passed as it is (the
    runtime puts only what is not laid out as the program reads it); a microbatch's slice of a batch input,
    or a value from another stage, is put."""
    B = num_microbatches
    step_inputs = set(graph.inputs)
    accumulated = {t for t in parts.accumulated if graph.tensors[t].inexact}
    per_micro_calls = per_micro_args = per_micro_puts = per_micro_adds = 0
    once_calls = once_args = once_puts = updates = 0
    reducing: set[int] = set()
    batch = {graph.inputs[i] for i in parts.batch_inputs}
    placed: set[tuple[int, int]] = set()  # (step input, physical stage)
    for seg in segments(graph, parts, stage_of_op, split_weight=weight_pass):
        here = seg.stage % num_stages
        moved = sum(t in batch or (t not in step_inputs and ((p := graph.tensors[t].producer) is None
                                                             or stage_of_op[p] % num_stages != here))
                    for t in seg.inputs)
        if seg.kind == UPDATE:
            updates += 1
            once_calls += 1
            once_args += max(len(seg.inputs) - 1, 0)
            once_puts += moved
            continue
        added = sum(t in accumulated for t in seg.outputs)
        if added:
            reducing.add(seg.stage)
        per_micro_calls += 1
        per_micro_adds += added
        per_micro_args += max(len(seg.inputs) - 1, 0)
        per_micro_puts += moved
        placed.update((t, here) for t in seg.inputs if t in step_inputs and t not in batch)
    once_puts += len(placed)  # a step's parameters, as the update left them, placed for the stages' programs
    # the batch sliced into microbatches; a reduction a stage; the accumulated results averaged
    once_calls += B * len(parts.batch_inputs) + len(reducing) + len(accumulated)
    calls = B * per_micro_calls + (B - 1) * per_micro_adds + once_calls  # the first microbatch's sums start
    args = B * per_micro_args + once_args
    puts = B * per_micro_puts + once_puts
    return HostWork(programs=B * per_micro_calls + updates, calls=calls, args=args, puts=puts,
                    seconds=calls * costs.call + args * costs.arg + puts * costs.put)

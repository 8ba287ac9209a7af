"""``emit``: a traced Graph plus a spec map becomes one sharded, jitted program (SPMD emission).

The program is ``jax.jit(run_graph, in_shardings=..., out_shardings=..., donate_argnums=...)`` over the
*flattened* arguments of the traced step, wrapped so that it takes and returns the same pytrees as the
traced function: ``new_state, metrics = emit(graph, specs, mesh)(state, batch)``.

Shardings at the boundary (the choices this module makes):

- an input with a top-level spec gets ``NamedSharding(mesh, P(*dims))``; an input without one is
  **replicated** (a fixed, predictable layout: a data-parallel map needs to name only the batch);
- an output with a spec gets its sharding; an output without one that is the new value of an input
  (``graph.output_aliases``: params, optimizer state) gets that input's sharding, so that the donated
  buffer can be reused in place; any other output is left to the partitioner;
- ``donate_argnums`` lists the flattened inputs that outputs alias (when ``donate=True``), so a train step
  updates its state in place. Batch leaves are not donated. Donated arguments are deleted by the call, and
  so may be arrays they were resharded from: pass ``step.place(state, batch)`` (fresh copies) the first time
  if the caller keeps using its own arrays.

Inside, ``Interpreter`` (``autoshard.emit.interpret``) binds the ops again and pins every spec'd value
with ``with_sharding_constraint``, recursively inside scan/while/cond/remat bodies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.emit.interpret import Interpreter
from autoshard.emit.specs import EmitError, normalize_key, validate_specs
from autoshard.trace.graph import Graph, Scope
from cost_models.spec import ShardingSpec

log = logging.getLogger("autoshard")


class ArgumentMismatch(EmitError):
    """An emitted step called with argument leaves whose shapes or dtypes differ from the traced ones."""


def check_leaves(graph: Graph, leaves: Sequence[Any], what: str, more: str = "") -> None:
    """``ArgumentMismatch`` naming the first of ``leaves`` whose shape or dtype differs from ``graph``'s input
    (a program checks this when jax.jit traces it for a new signature); ``what`` was traced, ``more``: other
    advice after parallelize's."""
    for i, (t, x) in enumerate(zip(graph.inputs, leaves, strict=True)):
        want = graph.tensors[t]
        if tuple(x.shape) != want.shape or str(x.dtype) != want.dtype:
            raise ArgumentMismatch(
                f"argument leaf {i} ({want.name}) is {x.dtype}{list(x.shape)}; the {what} was traced and "
                f"planned with {want.dtype}{list(want.shape)}: call autoshard.parallelize's step (it plans "
                f"again for new shapes){more}")


class EmittedStep:
    """A traced step re-emitted as one jitted SPMD program; call it like the traced function.

    Attributes: ``graph``, ``mesh``, ``specs``; ``in_shardings`` and ``out_shardings`` (one per flattened
    input / output leaf; ``None`` = left to the partitioner); ``donate_argnums`` (flattened input positions);
    ``jitted`` (the ``jax.jit`` of the flat function, taking and returning flat leaves); ``interpreter``
    (which, after a trace, reports constraints placed per scope and the bodies rebuilt).
    """

    def __init__(self, graph: Graph, specs: Mapping[Scope, Mapping[int, ShardingSpec]],
                 mesh: jax.sharding.Mesh, *, donate: bool = True) -> None:
        t0 = time.perf_counter()
        if graph.jaxpr is None or graph.in_tree is None or graph.out_tree is None:
            raise EmitError(
                "emit needs a top-level Graph from autoshard.trace (it keeps the jaxpr and the argument "
                "and result pytrees); a nested body Graph cannot be emitted on its own"
            )
        validate_specs(graph, specs, mesh)
        self.graph = graph
        self.mesh = mesh
        self.specs = {normalize_key(k): dict(v) for k, v in specs.items()}
        self.interpreter = Interpreter(mesh, self.specs)
        top = self.specs.get((), {})
        replicated = NamedSharding(mesh, PartitionSpec())
        sharding = self.interpreter.sharding
        self.in_shardings: tuple[NamedSharding, ...] = tuple(
            sharding(top[t]) if t in top else replicated for t in graph.inputs
        )
        outs: list[NamedSharding | None] = [sharding(top[t]) if t in top else None for t in graph.outputs]
        for o, i in graph.output_aliases.items():
            if outs[o] is None:
                outs[o] = self.in_shardings[i]
            elif outs[o] != self.in_shardings[i]:
                log.warning(
                    "autoshard.emit: output %s is the new value of input %s but their specs differ (%s vs "
                    "%s); the donated buffer cannot be reused in place",
                    graph.output_names[o], graph.tensors[graph.inputs[i]].name, outs[o].spec,
                    self.in_shardings[i].spec)
        self.out_shardings: tuple[NamedSharding | None, ...] = tuple(outs)
        self.donate_argnums: tuple[int, ...] = (
            tuple(sorted(set(graph.output_aliases.values()))) if donate else ()
        )
        self.jitted = jax.jit(
            self._flat_step,
            in_shardings=self.in_shardings,
            out_shardings=self.out_shardings,
            donate_argnums=self.donate_argnums,
        )
        # seconds building this object; None once the program is compiled (``_compile_logged``)
        self._unlogged: float | None = time.perf_counter() - t0

    # ---- the program -----------------------------------------------------------------------------------

    def _flat_step(self, *leaves: Any) -> tuple[Any, ...]:
        # runs only when jax.jit traces, i.e. for an argument signature it has not compiled yet: the graph's
        # ops carry the traced shapes, so leaves of other shapes are refused here, not replayed wrongly
        check_leaves(self.graph, leaves, "step", " or emit a plan made for these shapes")
        self.interpreter.reset()
        return tuple(self.interpreter.run(self.graph, (), leaves, pin_inputs=False))

    def flatten(self, *args: Any) -> list[Any]:
        """The flat leaves of ``args``, checked against the traced function's argument structure."""
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != self.graph.in_tree:
            raise EmitError(
                f"the arguments' pytree structure differs from the one traced:\n  traced: "
                f"{self.graph.in_tree}\n  given:  {tree}\npass arguments shaped like the example arguments "
                "given to autoshard.trace (same containers, keys and static fields)"
            )
        return leaves

    def __call__(self, *args: Any) -> Any:
        return self.call_flat(self.flatten(*args))

    def call_flat(self, leaves: Sequence[Any]) -> Any:
        """The step on the flat leaves of arguments with the traced pytree structure (not checked here: the
        caller flattened them and compared the structure); the result as the traced output pytree. Leaves of
        other shapes or dtypes raise ``ArgumentMismatch`` (when jax.jit traces for them)."""
        if self._unlogged is not None:
            self._compile_logged(leaves)
        return jax.tree_util.tree_unflatten(self.graph.out_tree, list(self.jitted(*leaves)))

    def _compile_logged(self, leaves: Sequence[Any]) -> None:
        """The first call's work, done ahead of it and reported to the ``autoshard`` logger at INFO: the
        emission (the graph's ops bound again under jax.jit, ``_flat_step``, and lowered to StableHLO) and
        XLA's compilation. jax.jit keeps both, so the call that follows runs the compiled program."""
        t0 = time.perf_counter()
        lowered = self.jitted.lower(*leaves)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        assert self._unlogged is not None
        log.info("emitted the step in %.1f s (%d ops bound again, %d sharding constraints, lowered "
                 "to StableHLO)", self._unlogged + t1 - t0, len(self.graph.ops),
                 sum(self.interpreter.constraints.values()))
        log.info("compiled the step in %.1f s (XLA, %d devices)", t2 - t1, self.mesh.devices.size)
        self._unlogged = None

    def place(self, *args: Any) -> tuple[Any, ...]:
        """``args`` as fresh arrays laid out with the input shardings, ready to be donated.

        The copies never share buffers with ``args``. On CPU, ``jax.device_put`` (even with
        ``may_alias=False``) and jit's own resharding of an uncommitted argument reuse a single-device
        array's buffer as one shard of a replicated array, so donating that array would delete the
        caller's original; a jitted ``jnp.copy`` does not.
        """
        return self._copied(args, range(len(self.in_shardings)))

    def place_state(self, *args: Any) -> tuple[Any, ...]:
        """``args`` with only the donated leaves (the train state) copied into their input layouts: the
        next step, fed this step's results and a fresh batch, then finds the same compiled program."""
        return self._copied(args, self.donate_argnums)

    def _copied(self, args: tuple[Any, ...], which: Sequence[int]) -> tuple[Any, ...]:
        """``args`` with the leaves at ``which`` replaced by fresh copies in their input shardings."""
        leaves = copied_leaves(list(self.flatten(*args)), which, self.in_shardings)
        return tuple(jax.tree_util.tree_unflatten(self.graph.in_tree, leaves))

    def lowered(self, *args: Any) -> jax.stages.Lowered:
        """``jitted.lower`` on the flattened arguments (``lowered(...).as_text()`` is StableHLO)."""
        return self.jitted.lower(*self.flatten(*args))

    def compiled(self, *args: Any) -> jax.stages.Compiled:
        """The compiled program (``compiled(...).as_text()`` shows the collectives the partitioner chose)."""
        return self.lowered(*args).compile()

    def donated_inputs(self) -> list[str]:
        """Names of the donated input leaves."""
        return [self.graph.tensors[self.graph.inputs[i]].name for i in self.donate_argnums]


def emit(graph: Graph, specs: Mapping[Scope, Mapping[int, ShardingSpec]] | None,
         mesh: jax.sharding.Mesh, donate: bool = True) -> EmittedStep:
    """Re-emit ``graph`` as one jitted SPMD program that pins ``specs`` on ``mesh``.

    ``specs`` is a ``SpecMap`` (see ``autoshard.emit.specs``); ``None`` or ``{}`` emits the step with
    replicated inputs and no constraints. The mesh's axes must be ``Auto``. The spec map is validated first;
    an ``EmitError`` names each tensor whose spec does not fit. ``donate=True`` donates the train-state
    inputs that the step returns new values of.
    """
    return EmittedStep(graph, specs or {}, mesh, donate=donate)


def global_rel_error(a: Any, b: Any) -> float:
    """‖a − b‖ / ‖a‖ over all leaves of two pytrees together (the project's numerics measure)."""
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    if len(la) != len(lb):
        raise ValueError(f"pytrees differ: {len(la)} leaves vs {len(lb)}")
    num = den = 0.0
    for x, y in zip(la, lb, strict=True):
        x64 = np.asarray(x, dtype=np.float64)
        y64 = np.asarray(y, dtype=np.float64)
        num += float(np.sum((x64 - y64) ** 2))
        den += float(np.sum(x64**2))
    return float(np.sqrt(num) / np.sqrt(den)) if den > 0 else float(np.sqrt(num))


def _whole(x: Any, sharding: Any) -> Any:
    """``copied_leaves``' input sharding for ``x`` headed for ``sharding``: replicated over its mesh when
    ``x`` is whole in one place (an array on one device, a numpy array, a number), else None (as it is)."""
    here = getattr(x, "sharding", None)
    if here is not None and len(here.device_set) > 1:
        return None
    return NamedSharding(sharding.mesh, PartitionSpec()) if isinstance(sharding, NamedSharding) else None


def copied_leaves(leaves: list[Any], which: Sequence[int], shardings: Sequence[Any]) -> list[Any]:
    """``leaves`` with those at ``which`` replaced by fresh copies laid out as ``shardings[i]``: a jitted
    ``jnp.copy``, which never hands back the caller's buffer (``EmittedStep.place``), so that a program
    donating them leaves the caller's arrays alive.

    A leaf on one device (or on the host) goes in replicated over the target mesh (``_whole``) and is sliced
    inside the copy: handed over as it is, jax would first split it with a small compiled slicing program
    per distinct shape and layout (tiny GPT's state on 2x4: 10 of them, 14% of a cached plan's first call).
    Replicating it sends the whole leaf to each device (no program), which a device holding the whole
    leaf already has room for."""
    which = list(which)
    if which:
        copy = jax.jit(lambda *xs: tuple(jax.numpy.copy(x) for x in xs),
                       in_shardings=tuple(_whole(leaves[i], shardings[i]) for i in which),
                       out_shardings=tuple(shardings[i] for i in which))
        for i, x in zip(which, copy(*(leaves[i] for i in which)), strict=True):
            leaves[i] = x
    return leaves

"""Train states saved as a plan lays them out and restored under any other plan, mesh or process count.

A plan decides where every leaf of the train state lives: ZeRO shards, tensor-parallel splits, a layer
stack's rows split over the SPMD pipeline's stage axis. Saving goes through orbax (``orbax-checkpoint``,
the JAX ecosystem's checkpoint library): each process writes the shards it holds (tensorstore, OCDBT), no
leaf is gathered to one host, and a step's directory appears only once every process has finished it (an
interrupted save leaves no step behind, so ``latest_step`` is always a whole state). Restoring reads, on
each device, only the part of each leaf that the *target* layout puts there, so a state saved on a (2, 4)
mesh by two processes restores on (4, 2), (8,) or one process of 4 devices alike.

The state a user holds is always the step's own pytree, whatever the plan: the SPMD pipeline program keeps
a layer stack's parameters and optimizer state ``[K, ...]`` between calls (rows split over the stage axis,
``pipeline.spmd_program.on_stages``) and stacks them per stage only inside its program, and the MPMD
runtime returns each leaf on its stage's submesh. So a checkpoint holds plain arrays, and moving between
plans is a matter of target layouts:

- ``state_shardings``: the layouts a compiled program reads its argument ``argnum`` in (restored straight
  there, the program's first call moves nothing);
- ``even_shardings``: before any program exists, each leaf split over all the mesh's devices along its
  largest dimension they divide (replicated when none does): no device holds more than its share, and the
  first call lays the state out as its plan says.

``parallelize.save`` and ``parallelize.restore`` (``api``) are these with the step's mesh and program.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.errors import AutoshardError

log = logging.getLogger("autoshard")


class CheckpointError(AutoshardError, ValueError):
    """No checkpoint to restore, or one whose leaves do not match the state asked for."""


def _manager(directory: str | Path, keep: int | None = None) -> Any:
    import orbax.checkpoint as ocp  # imported here: a second or two that steps without checkpoints never pay

    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False, create=True)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options,
                                 item_handlers=ocp.StandardCheckpointHandler())


def save(directory: str | Path, state: Any, step: int, *, keep: int | None = None) -> Path:
    """Save ``state`` (a pytree of arrays: jax arrays as the plan laid them out, numpy arrays, numbers) as
    step ``step`` under ``directory``; every process must call it (each writes its own shards). ``keep``:
    keep only the newest ``keep`` steps. Returns the step's directory."""
    import orbax.checkpoint as ocp

    mgr = _manager(directory, keep)
    try:
        if step in mgr.all_steps():
            raise CheckpointError(f"{directory} already holds step {step}: save each step number once (count "
                                  "on from the restored step), or save under another directory")
        mgr.save(step, args=ocp.args.StandardSave(state))
        mgr.wait_until_finished()
    finally:
        mgr.close()
    return Path(directory).absolute() / str(step)


def steps(directory: str | Path) -> list[int]:
    """The steps saved (whole) under ``directory``, in order; [] when there is none."""
    if not Path(directory).is_dir():
        return []
    mgr = _manager(directory)
    try:
        return sorted(mgr.all_steps())
    finally:
        mgr.close()


def latest_step(directory: str | Path) -> int | None:
    """The newest whole step under ``directory``, or None."""
    found = steps(directory)
    return found[-1] if found else None


def restore(directory: str | Path, like: Any, *, step: int | None = None, shardings: Any = None) -> Any:
    """The state saved as step ``step`` (default: the newest) under ``directory``, with ``like``'s structure
    (a pytree of arrays or ``jax.ShapeDtypeStruct``: ``jax.eval_shape`` of the initialiser allocates nothing).
    ``shardings``: a pytree of ``jax.sharding.Sharding`` like ``like`` (``state_shardings``, ``even_shardings``);
    None: each array leaf of ``like`` keeps its own sharding (a leaf without one is an error). Every process
    must call it; each reads only its devices' parts."""
    import orbax.checkpoint as ocp

    if not Path(directory).is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    mgr = _manager(directory)
    try:
        if step is None:
            step = mgr.latest_step()
            if step is None:
                raise CheckpointError(f"{directory} holds no whole checkpoint (an interrupted save leaves none)")
        elif step not in mgr.all_steps():
            raise CheckpointError(f"{directory} holds no step {step}; it holds {sorted(mgr.all_steps())}")
        target = _abstract(like, shardings)
        try:
            out = mgr.restore(step, args=ocp.args.StandardRestore(target))
        except (ValueError, KeyError, TypeError) as e:
            why = _mismatch(mgr, step, like) or f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            raise CheckpointError(
                f"step {step} under {directory} does not match the state asked for ({why}): pass like= a state "
                "of the same structure, shapes and dtypes as the one saved (the same model and optimizer)") from None
    finally:
        mgr.close()
    _check_shapes(like, out, directory, step)
    log.info("restored step %d from %s", step, directory)
    return out


def _abstract(like: Any, shardings: Any) -> Any:
    """``like`` as orbax's restore target: array leaves as ``jax.ShapeDtypeStruct`` carrying their target
    sharding; numbers kept."""
    leaves, tree = jax.tree_util.tree_flatten(like)
    if shardings is None:
        targets = [getattr(x, "sharding", None) for x in leaves]
    else:
        targets = tree.flatten_up_to(shardings)
    out = []
    for path_leaf, x, s in zip(jax.tree_util.tree_flatten_with_path(like)[0], leaves, targets, strict=True):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            out.append(x)
            continue
        if s is None:
            raise CheckpointError(f"state leaf {jax.tree_util.keystr(path_leaf[0])} has no sharding to restore "
                                  "into: pass shardings= (even_shardings(like, mesh)), or restore through "
                                  "the decorated step (step.restore)")
        out.append(jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=s))
    return jax.tree_util.tree_unflatten(tree, out)


def _names(path: tuple[Any, ...]) -> str:
    """A pytree path as orbax names a saved leaf's place: keys, attribute names and indices joined by ``.``."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def _mismatch(mgr: Any, step: int, like: Any) -> str | None:
    """The first leaf where the saved state and ``like`` differ (missing, extra, another shape or dtype),
    read off the checkpoint's metadata; None when the metadata cannot say."""
    try:
        meta = mgr.item_metadata(step)
        tree = getattr(meta, "tree", meta)
        saved = {_names(p): m for p, m in jax.tree_util.tree_flatten_with_path(tree)[0]}
    except Exception:  # an older layout or a missing file: orbax's own message stands
        return None
    wanted = {_names(p): x for p, x in jax.tree_util.tree_flatten_with_path(like)[0]}
    for name, x in wanted.items():
        m = saved.get(name)
        if m is None:
            return f"the saved state has no leaf {name}"
        shape, dtype = getattr(m, "shape", None), getattr(m, "dtype", None)
        if hasattr(x, "shape") and shape is not None and tuple(shape) != tuple(x.shape):
            return f"leaf {name} was saved as {np.dtype(dtype)}{list(shape)}, asked for as {np.dtype(x.dtype)}{list(x.shape)}"
    extra = sorted(set(saved) - set(wanted))
    return f"the saved state also holds {extra[0]}" if extra else None


def _check_shapes(like: Any, got: Any, directory: str | Path, step: int) -> None:
    """Each restored leaf has the shape and dtype asked for (orbax pads or truncates silently in some
    versions when a saved array's shape differs from the target's)."""
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(like)[0], jax.tree.leaves(got), strict=True):
        if hasattr(x, "shape") and (tuple(np.shape(y)) != tuple(x.shape) or np.dtype(y.dtype) != np.dtype(x.dtype)):
            raise CheckpointError(f"step {step} under {directory}: leaf {jax.tree_util.keystr(path)} came back "
                                  f"{np.dtype(y.dtype)}{list(np.shape(y))}, not the {np.dtype(x.dtype)}"
                                  f"{list(x.shape)} asked for")


# ---- target layouts ---------------------------------------------------------------------------------------


def even_shardings(like: Any, mesh: jax.sharding.Mesh) -> Any:
    """For each array leaf of ``like``, a sharding over all of ``mesh``'s devices: split along its largest
    dimension that their number divides, else replicated (a scalar, a small odd-sized bias). No device holds
    more than its share of any leaf that can be split."""
    n = math.prod(mesh.devices.shape)

    def one(x: Any) -> Any:
        if not hasattr(x, "shape"):  # a number: kept as it is (``_abstract``)
            return NamedSharding(mesh, PartitionSpec())
        shape = tuple(x.shape)
        dims = sorted((d for d in range(len(shape)) if shape[d] % n == 0 and shape[d] > 0), key=lambda d: -shape[d])
        if not dims or n == 1:
            return NamedSharding(mesh, PartitionSpec())
        spec: list[Any] = [None] * len(shape)
        spec[dims[0]] = tuple(mesh.axis_names)
        return NamedSharding(mesh, PartitionSpec(*spec))

    return jax.tree.map(one, like)


def state_shardings(program: Any, like: Any, argnum: int) -> Any:
    """The shardings ``program`` (a compiled step: ``EmittedStep``, ``SpmdPipelineStep``, or either under
    ``distributed.GlobalStep``) reads its argument ``argnum`` in, as a pytree like ``like``; None when the
    program has no single layout per input (the MPMD runtime places each stage's inputs itself) or its
    argument ``argnum`` is not shaped like ``like``."""
    program = getattr(program, "emitted", program)
    in_shardings = getattr(program, "in_shardings", None)
    in_tree = getattr(getattr(program, "graph", None), "in_tree", None)
    if in_shardings is None or in_tree is None:
        return None
    args = in_tree.children()
    if argnum >= len(args) or args[argnum] != jax.tree.structure(like):
        return None
    start = sum(a.num_leaves for a in args[:argnum])
    return jax.tree_util.tree_unflatten(args[argnum], list(in_shardings[start:start + args[argnum].num_leaves]))

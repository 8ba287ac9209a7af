"""The public surface: ``autoshard.plan`` (pure planning on a logical mesh) and ``@autoshard.parallelize``
(trace, plan, emit and run on the devices present)."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from autoshard import cache as plan_cache
from autoshard import checkpoint, distributed, nnx_steps
from autoshard.choose import choose
from autoshard.emit import emit
from autoshard.emit.program import ArgumentMismatch, EmittedStep
from autoshard.options import PARALLELIZE_DEFAULTS, PLAN_DEFAULTS, PlanOptions
from autoshard.options import signature as options_signature
from autoshard.pipeline import PipelinePlan, build_pipelined_step, explain_pipeline, trace_microbatch
from autoshard.pipeline.report import random_note
from autoshard.pipeline.spmd_program import SpmdPipelineStep, spmd_pipeline_step, tail_graph
from autoshard.planner.deadline import Deadline
from autoshard.planner.explain import explain_plan
from autoshard.planner.plan import Plan, PlanError
from autoshard.planner.recompute import as_planned, recomputed
from autoshard.planner.summary import with_input_classes
from autoshard.planner.utilization import model_flops
from autoshard.target import (
    MeshLike,
    PipelineOptions,
    PlanningError,
    Target,
    check_time_budget,
    parse_mesh,
    runs_spmd,
)
from autoshard.trace import Graph, trace
from autoshard.trace.structure import block_labels
from autoshard.trace.unroll import unroll_layer_stacks

log = logging.getLogger("autoshard")


def plan(step_fn: Callable[..., Any] | Graph, *args: Any, options: PlanOptions | None = None,
         **kwargs: Any) -> Plan | PipelinePlan:
    """Plan ``step_fn(*args)`` on a logical mesh; no devices needed (args may be ShapeDtypeStructs, or
    ``step_fn`` a traced ``Graph`` and no args).

    The options are ``autoshard.PlanOptions``' fields, whose documentation says what each does: give them
    as ``options=PlanOptions(...)``, as keywords (``mesh="8x8", microbatches=8``), or both (the keywords
    replace those fields of ``options``). Here ``mesh`` defaults to ``(8,)`` and ``hardware`` to ``"h100"``
    (``options.PLAN_DEFAULTS``). The signature ``help`` and IDEs show lists the fields as keywords: it is
    built from ``PlanOptions`` (``options.signature``), where each is written once.

    The step is traced (progress to the ``"autoshard"`` logger at INFO), planned on the mesh as one
    intra-operator plan, and, with ``microbatches`` or when it does not fit unpipelined as traced, as a
    pipeline too; the faster plan is returned (a ``Plan`` or a ``PipelinePlan``).
    """
    opts = PlanOptions.of(options, **kwargs)
    target = opts.target(PLAN_DEFAULTS)
    return plan_for(step_fn, args, target, opts.pipeline_options(target), time_budget_s=opts.time_budget_s,
                    roles=opts.input_roles(), recompute=opts.recompute, unroll_scans=opts.unroll_scans)[0]


plan.__signature__ = options_signature(plan, PLAN_DEFAULTS)  # type: ignore[attr-defined]


def plan_for(step_fn: Callable[..., Any] | Graph, args: tuple[Any, ...], target: Target, options: PipelineOptions,
             *, time_budget_s: float | None, roles: Mapping[str, str] | None = None, recompute: str = "auto",
             traced: Graph | None = None, deadline: Deadline | None = None, unroll_scans: bool = True,
             ) -> tuple[Plan | PipelinePlan, Graph, Graph | None]:
    """``plan`` on a resolved target, also returning the traces it made: (plan, the graph it plans (the
    step's, rewritten when the plan recomputes), the microbatch-sized graph or None), so that
    ``parallelize`` emits from them instead of tracing again. ``traced``: ``step_fn`` already traced with
    ``args`` (``distributed.compile_everywhere`` traces it on every process first). ``deadline``: the one
    clock every phase reads (``planner.deadline``; default: ``time_budget_s`` from now on the wall clock;
    tests pass one on a fake clock). What a spent budget cut short is said in the log and in the plan's
    ``solver.cut_short``. ``unroll_scans`` (``PlanOptions.unroll_scans``): a traced step's layer stacks
    written as one scan are unrolled (``trace.unroll``) before anything is planned, and an intra-operator
    plan says so (``Plan.unrolled``); a ``Graph`` given is planned as it is."""
    check_time_budget(time_budget_s)
    if deadline is None:
        deadline = Deadline(time_budget_s)
    t0 = deadline.start
    assert t0 is not None
    if not isinstance(step_fn, Graph) and nnx_steps.holds_nnx(args):  # updates nnx objects in place
        call = nnx_steps.split(step_fn, args)
        step_fn, args = call.step, call.args
    if isinstance(step_fn, Graph) or traced is not None:
        graph = step_fn if isinstance(step_fn, Graph) else traced
    else:
        graph = trace(step_fn, *args, roles=roles)
    t_trace = None if isinstance(step_fn, Graph) else deadline.elapsed()
    if t_trace is not None and traced is None:
        log.info("traced the step: %d ops in %.1f s", len(graph.ops), t_trace)
    written = graph
    if unroll_scans and not isinstance(step_fn, Graph):
        graph = unroll_layer_stacks(graph, why="planned and emitted unrolled (unroll_scans=False keeps the scan)")
    unrolled = graph is not written
    # a plan cached by an earlier launch (``autoshard.cache``): checked against this trace, else planned
    key = plan_cache.key(graph, target, options, time_budget_s=time_budget_s, recompute=recompute,
                         name=getattr(step_fn, "__qualname__", type(step_fn).__name__))
    if (hit := plan_cache.lookup(key, step_fn, args, graph, roles)) is not None:
        _warn_if_random(hit[0], hit[2], graph)
        return hit
    flops = model_flops(graph, target.cost.device)  # of the step as written (before any recompute)
    the_plan, planned, micro = choose(step_fn, args, graph, deadline, t_trace, target, options,
                                       time_budget_s=time_budget_s, roles=roles, recompute=recompute)
    _warn_if_overrun(the_plan, time_budget_s, deadline.elapsed(), t_trace)
    the_plan = dataclasses.replace(the_plan, model_flops=flops)
    if isinstance(the_plan, Plan) and unrolled:
        the_plan = dataclasses.replace(the_plan, unrolled=True)
    if isinstance(the_plan, Plan):  # classes for its summary, from the step's blocks (``summary.input_class``)
        the_plan = with_input_classes(the_plan, block_labels(graph))
    if (note := deadline.note()) is not None:  # the summary says what the spent budget cut short
        the_plan = dataclasses.replace(the_plan, solver=dataclasses.replace(the_plan.solver, cut_short=note))
    plan_cache.store(key, the_plan)
    _warn_if_random(the_plan, micro, graph)
    return the_plan, planned, micro


def _warn_if_random(the_plan: Plan | PipelinePlan, micro: Graph | None, graph: Graph) -> None:
    """A pipelined plan of a step that draws random numbers as no pipeline can draw them as jax.jit does says
    what each microbatch draws (``random_note``)."""
    if isinstance(the_plan, PipelinePlan) and micro is not None and (
            note := random_note(micro, graph, the_plan.num_microbatches)):
        log.warning("%s", note)


OVERRUN = 1.5  # a call that took this many times its time budget (and 2 s more) says so


def _warn_if_overrun(plan: Plan | PipelinePlan, budget: float | None, took: float, t_trace: float | None) -> bool:
    """Say (and return) when planning ran well past the user's time budget: the budget was shorter than what
    any plan of the step needs (``autoshard plan examples/gpt.py --preset 1.3b --mesh 2x4 --time-budget 5``:
    24.7 s, the step does not fit as traced and its pipeline's least times, tracing at the microbatch size
    and a least time per layer solve, add up past the budget). The overrun itself is not cured here."""
    if budget is None or took <= OVERRUN * budget or took <= budget + 2.0:
        return False
    why = ("the step was planned as a pipeline, whose tracing at the microbatch size and least time per layer and "
           "stage solve add up past it" if isinstance(plan, PipelinePlan) else
           "building the solver's problem and its least solving time add up past it")
    log.warning("planning took %.1f s, %.1fx its %.3g s time budget (tracing %s): the budget is shorter than what "
                "a plan of this step needs: %s. Give it more time (time_budget_s=..., --time-budget), or leave it "
                "out to have it scaled to the step.", took, took / budget, budget,
                "none" if t_trace is None else f"{t_trace:.1f} s", why)
    return True


def explain(plan: Plan | PipelinePlan) -> str:
    """A plan for a person: for an intra-operator plan the layouts per parameter class and per layer, the
    step time by category, memory by kind and where the time goes (``planner.explain``); for a pipelined
    plan its stages, submeshes and the time split into stage work, bubble and update."""
    if isinstance(plan, PipelinePlan):
        return explain_pipeline(plan)
    return explain_plan(plan).text()


def _device_mesh(mesh: MeshLike | None) -> jax.sharding.Mesh:
    """The devices a step runs on. A ``jax.sharding.Mesh`` keeps its devices and axis names (its axes made
    Auto, which sharding constraints need); a shape takes the first devices present (all of them on one
    axis when ``mesh`` is None)."""
    if isinstance(mesh, jax.sharding.Mesh):
        return jax.sharding.Mesh(mesh.devices, mesh.axis_names)
    if isinstance(mesh, jax.sharding.AbstractMesh):
        raise PlanningError("an AbstractMesh has no devices to run on: plan with autoshard.plan(mesh=...), or "
                            "pass parallelize a jax.sharding.Mesh (jax.make_mesh) or a shape such as (2, 4)")
    devices = jax.devices()
    shape, names = parse_mesh(mesh if mesh is not None else (len(devices),))
    n = int(np.prod(shape))
    if n > len(devices):
        raise PlanningError(
            f"mesh {'x'.join(map(str, shape))} needs {n} devices but {len(devices)} are present; plan for a "
            "larger cluster with autoshard.plan (no devices needed), or pick a smaller mesh"
        )
    return jax.sharding.Mesh(np.array(devices[:n]).reshape(shape), names)


def load_plan(path: str | Path) -> Plan | PipelinePlan:
    """A plan saved with ``plan.save(path)`` (or ``autoshard plan -o``), intra-operator or pipelined."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"{path}: cannot read a plan ({e})") from None
    if isinstance(data, dict) and data.get("kind") == "pipeline":
        try:
            return PipelinePlan.from_dict(data)
        except (KeyError, TypeError, ValueError) as e:  # PlanError included: name the file
            raise PlanError(f"{path}: not a pipeline plan that holds together ({type(e).__name__}: {e}); plan "
                            "again (autoshard plan ... -o FILE)") from None
    return Plan.load(path)


def _on_mesh(plan: Plan | PipelinePlan, mesh: jax.sharding.Mesh) -> Plan | PipelinePlan:
    """``plan`` ready to run on ``mesh``: as it is when the mesh has the plan's axes (names and sizes, in any
    order); when the mesh has the plan's shape under other names (``jax.make_mesh((2, 4), ("data", "model"))``
    for a plan on ``x=2, y=4``), with its axes matched by position (``Plan.with_axis_names``: the program is
    emitted with the mesh's names; a pipeline's stages name their own submeshes' axes, so it runs as it is).
    Refused when the shapes differ, or when the mesh uses one of the plan's axis names at another position
    (matching by position would then give that name another axis's meaning)."""
    have = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    want = dict(zip(plan.mesh.axis_names, plan.mesh.shape, strict=True))
    if have == want:
        return plan
    shape = tuple(plan.mesh.shape)
    hint = (f"pass mesh={shape} or a jax Mesh of shape {shape} (its axes are matched to the plan's by position), "
            "or plan again for this mesh")
    if tuple(mesh.devices.shape) != shape:
        raise PlanningError(f"the given plan was made for the mesh {want}, but this step runs on {have}: {hint}")
    moved = [a for i, a in enumerate(mesh.axis_names) if a in want and plan.mesh.axis_names[i] != a]
    if moved:
        raise PlanningError(
            f"the given plan was made for the mesh {want}, but this step runs on {have}: the shapes agree, but the "
            f"mesh names its axis {moved[0]!r} after another of the plan's axes, so matching the axes by position "
            f"would be ambiguous. Name the mesh's axes {tuple(plan.mesh.axis_names)} (or names the plan does not "
            "use), or plan again for this mesh")
    log.info("the plan's mesh axes %s run on the mesh's axes %s (matched by position)",
             ", ".join(plan.mesh.axis_names), ", ".join(mesh.axis_names))
    return plan.with_axis_names(mesh.axis_names) if isinstance(plan, Plan) else plan


def trace_for_plan(the_plan: Plan | PipelinePlan, fn: Callable[..., Any], args: tuple[Any, ...], *,
                   roles: Mapping[str | int, str] | None = None) -> tuple[Graph, Graph | None]:
    """The traces a saved plan runs (or is explained) on, checked against it (``verify``): for a ``Plan``
    the step's trace rewritten as the plan was planned (``as_planned``: unrolled, recomputing), and None;
    for a ``PipelinePlan`` the step's trace and the trace at microbatch size (``num_microbatches``) with the
    plan's recompute applied."""
    graph = trace(fn, *args, roles=roles)
    if isinstance(the_plan, Plan):
        graph = as_planned(graph, the_plan)
        the_plan.verify(graph)
        return graph, None
    micro = trace_microbatch(fn, args, graph, the_plan.num_microbatches, roles=roles)
    micro = recomputed(micro, the_plan.recompute)
    the_plan.verify(micro)
    return graph, micro


def _cache_key(leaves: list[Any], tree: Any) -> Any:
    """Arguments that compile to the same program get the same key: the pytree structure (``tree``, of the
    flat ``leaves``) and each leaf's shape and dtype as JAX sees it (a Python ``0`` and the int32 array a
    step returns for it are alike)."""
    # dtype objects, not strings: str(dtype) took ~25 us a leaf, milliseconds a step on GPT-sized trees
    return tree, tuple((x.shape, x.dtype) if hasattr(x, "dtype") else ((), _number_dtype(x)) for x in leaves)


_NUMBERS = (bool, int, float, complex)


def _number_dtype(x: Any) -> Any:
    """The dtype JAX gives a Python number; a TypeError for any other leaf without a dtype (a string, which
    ``jnp.result_type`` would read as a dtype name, a function, an arbitrary object): ``_not_an_array``."""
    if not isinstance(x, _NUMBERS):
        raise TypeError(f"{type(x).__name__} is not an array or a number")
    return jax.numpy.result_type(x)


def _not_an_array(fn: Callable[..., Any], args: tuple[Any, ...], error: TypeError) -> Exception:
    """The error for the first argument leaf of ``fn(*args)`` that is neither an array nor a Python number,
    named by its path (``batch.name``); ``error`` itself when every leaf is one."""
    from autoshard.errors import TraceError
    from autoshard.trace.roles import arg_names, leaf_name

    names = arg_names(fn, len(args))
    for path, x in jax.tree_util.tree_flatten_with_path(args)[0]:
        if hasattr(x, "dtype") or isinstance(x, _NUMBERS):
            continue
        name = leaf_name(names[path[0].idx], path[1:])
        shown = repr(x) if len(repr(x)) <= 40 else repr(x)[:37] + "..."
        return TraceError(
            f"argument {name} is a {type(x).__name__} ({shown}), not an array: a parallelized step's arguments "
            "must hold arrays (jax or numpy) or Python numbers as leaves. If it does not change between calls, "
            "make it static: a static field of its pytree (flax.struct.field(pytree_node=False), "
            "equinox.field(static=True)), or take it out of the arguments and close over it (a closure, or "
            "functools.partial(step, ...) over a parameter of its own), passing only arrays")
    return error


_MISS = object()  # parallelize._fast: no compiled program was found for the arguments


@dataclasses.dataclass(slots=True)
class _Compiled:
    graph: Graph  # for a pipelined plan: the trace at microbatch size
    plan: Plan | PipelinePlan
    step: Any
    fn: Callable[..., Any] | None = None  # the function compiled: the step, or an nnx step's pure form


class parallelize:  # lower case: used as a decorator, like jax.jit
    """Decorate a train step: the first call traces, plans and compiles it for the mesh; later calls with
    the same argument shapes reuse the compiled program. ``.plan`` is the latest plan, ``.explain()``
    prints it.

    The options are ``autoshard.plan``'s, ``autoshard.PlanOptions``' fields (``options=``, keywords, or both:
    the keywords replace those fields), and the signature lists them (``options.signature``). Here the
    defaults are the devices present (``options.PARALLELIZE_DEFAULTS``): ``mesh`` all of them on one axis,
    ``hardware="auto"`` their preset; a ``jax.sharding.Mesh`` (e.g. from ``jax.make_mesh``, or over a subset
    of the devices) runs on its own devices with its axis names. ``runtime`` also says how a pipelined plan
    runs (``PlanOptions.runtime``): it is planned for that runtime and runs on the one it was priced for
    (``target.runs_spmd``). ``plan=`` (a Plan, a PipelinePlan or the path of a saved one) runs that plan
    instead of planning; it must have been made for this step and this mesh's shape. A flax nnx step that
    updates the objects it is given (``optimizer.update(model, grads)``) runs as ``nnx.jit`` runs it
    (``autoshard.nnx_steps``).

        @autoshard.parallelize(mesh=(2, 4))
        def train_step(state, batch): ...
    """

    def __init__(self, fn: Callable[..., Any] | None = None, *, options: PlanOptions | None = None,
                 plan: Plan | PipelinePlan | str | Path | None = None, **kwargs: Any) -> None:
        # checked now; resolved at the first call: "auto" hardware and the default mesh look at the devices,
        # which must wait until the user has set up JAX (jax.distributed.initialize, platform flags)
        self.options = PlanOptions.of(options, **kwargs)
        self.fn = fn
        self.given_plan = load_plan(plan) if isinstance(plan, str | Path) else plan
        self._devices: jax.sharding.Mesh | None = None
        self._target: Target | None = None
        self.roles = self.options.input_roles()
        self._cache: dict[Any, _Compiled] = {}
        self._last: _Compiled | None = None
        self._functional: list[nnx_steps.Functional] = []  # the pure forms of an nnx step, one per graph

    def __call__(self, *args: Any) -> Any:
        if self.fn is None:  # used as @parallelize(...): the first call receives the function
            (fn,) = args
            self.fn = fn
            return self
        flat = None
        if self._last is None or self._last.fn is self.fn:  # (after an nnx call, no plain fast path to try)
            flat = jax.tree_util.tree_flatten(args)
            out = self._fast(self.fn, *flat)
            if out is not _MISS:
                return out
        if nnx_steps.holds_nnx(args):  # a flax nnx step updating its objects in place: run as nnx.jit does
            call = nnx_steps.split(self.fn, args, self._functional)
            if call.functional not in self._functional:
                self._functional.append(call.functional)
            return call.finish(self._run(call.step, call.args))
        return self._run(self.fn, args, flat)

    def _fast(self, fn: Callable[..., Any], leaves: list[Any], tree: Any) -> Any:
        """The steady state, a step fed its own last results: no signature built or hashed (~2 ms a call
        on GPT-350M's 879 leaves); the program's own trace-time check refuses other shapes. ``_MISS`` when
        the last program is not for these arguments."""
        last = self._last
        if (last is not None and last.fn is fn and isinstance(last.step, EmittedStep | SpmdPipelineStep)
                and tree == last.step.graph.in_tree):
            try:
                return last.step.call_flat(leaves)
            except (ArgumentMismatch, TypeError):  # a TypeError: a leaf that is no array, named by _run
                pass
        return _MISS

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], flat: tuple[list[Any], Any] | None = None) -> Any:
        """``fn(*args)`` by its compiled program, compiled at the first call with arguments like these;
        ``flat``: ``args`` flattened, when ``_fast`` has already tried them."""
        if flat is None:
            flat = jax.tree_util.tree_flatten(args)
            out = self._fast(fn, *flat)
            if out is not _MISS:
                return out
        try:
            key = _cache_key(*flat) if fn is self.fn else (fn, _cache_key(*flat))
        except TypeError as e:
            raise _not_an_array(fn, args, e) from None
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._compile(fn, args)
            self._cache[key] = compiled
        if compiled is not self._last:
            place = getattr(compiled.step, "place_state", None)
            if place is not None:
                # laid out (and copied) as the program wants them: the next call, fed this call's
                # results, then hits the same compiled program instead of compiling a second one for
                # arguments that are already on the devices; and a step switching back to an earlier
                # program brings arrays laid out by the other one, which jax.jit refuses as arguments
                args = place(*args)
        self._last = compiled
        return compiled.step(*args)

    @property
    def device_mesh(self) -> jax.sharding.Mesh:
        """The devices the step runs on, as a mesh with the plan's axis names."""
        if self._devices is None:
            self._devices = _device_mesh(self.options.mesh)
        return self._devices

    @property
    def target(self) -> Target:
        """The mesh, hardware and memory budget this step is planned for."""
        if self._target is None:
            mesh = self.device_mesh
            on_devices = dataclasses.replace(self.options, mesh=dict(zip(mesh.axis_names, mesh.devices.shape,
                                                                         strict=True)))
            self._target = on_devices.target(PARALLELIZE_DEFAULTS)
        return self._target

    def _compile(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> _Compiled:
        device_mesh = self.device_mesh
        multi = distributed.multiprocess()
        processes = jax.process_count() if multi else 1
        options = self.options.pipeline_options(self.target, processes)
        budget, recompute = self.options.time_budget_s, self.options.recompute
        if multi:  # planned on process 0, agreed by all: autoshard.distributed
            given = None if self.given_plan is None else _on_mesh(self.given_plan, device_mesh)
            return _Compiled(*distributed.compile_everywhere(
                fn, args, self.roles, options, device_mesh,
                lambda shapes, traced: plan_for(fn, shapes, self.target, options, time_budget_s=budget,
                                                roles=self.roles, recompute=recompute, traced=traced,
                                                unroll_scans=self.options.unroll_scans)[0],
                given), fn=fn)
        if self.given_plan is not None:
            the_plan, graph, micro = self._given(fn, args, device_mesh)
        else:
            the_plan, graph, micro = plan_for(fn, args, self.target, options, time_budget_s=budget,
                                              roles=self.roles, recompute=recompute,
                                              unroll_scans=self.options.unroll_scans)
        if isinstance(the_plan, Plan):  # tracing ran nothing: concrete args were fine
            return _Compiled(graph, the_plan, emit(graph, the_plan.specs, device_mesh), fn)
        assert micro is not None
        devices = list(device_mesh.devices.flat)
        if runs_spmd(self.options.runtime, the_plan.spmd, processes):  # a plan runs on the runtime it was priced for
            tail = tail_graph(fn, args, graph, the_plan, roles=self.roles)
            return _Compiled(micro, the_plan, spmd_pipeline_step(micro, graph, the_plan, devices, tail), fn)
        return _Compiled(micro, the_plan, build_pipelined_step(micro, the_plan, devices, graph), fn)

    def _given(self, fn: Callable[..., Any], args: tuple[Any, ...],
               mesh: jax.sharding.Mesh) -> tuple[Plan | PipelinePlan, Graph, Graph | None]:
        """The user's plan checked against this step's trace and the devices, instead of planning."""
        assert self.given_plan is not None
        the_plan = _on_mesh(self.given_plan, mesh)
        graph, micro = trace_for_plan(the_plan, fn, args, roles=self.roles)
        return the_plan, graph, micro

    @property
    def plan(self) -> Plan | PipelinePlan:
        if self._last is None:
            raise PlanningError("no plan yet: call the decorated step once (it plans on its first call)")
        return self._last.plan

    @property
    def graph(self) -> Graph:
        if self._last is None:
            raise PlanningError("no graph yet: call the decorated step once")
        return self._last.graph

    def explain(self) -> str:
        return explain(self.plan)

    # -- checkpoints (``autoshard.checkpoint``) ------------------------------------------------------------

    def save(self, directory: str | Path, state: Any, step: int, *, keep: int | None = None) -> Path:
        """Save ``state`` (the step's train state, as its last call returned it) as step ``step`` under
        ``directory`` with orbax: each process writes the shards it holds. ``keep``: keep the newest only."""
        return checkpoint.save(directory, state, step, keep=keep)

    def restore(self, directory: str | Path, like: Any, *, step: int | None = None,
                args: tuple[Any, ...] | None = None, argnum: int = 0) -> Any:
        """The state saved under ``directory`` (step ``step``, default the newest), restored for this step's
        mesh and plan whatever mesh, plan or process count saved it. ``like``: the state's structure (arrays
        or ``jax.eval_shape`` of the initialiser). It comes back in the layout the step's program reads its
        argument ``argnum`` in: the program compiled for ``args`` (the step's arguments, ``like`` among them;
        planned now, or found in the plan cache) or, without ``args``, the last one called; before any
        program, evenly split over the mesh (``checkpoint.even_shardings``), and the first call lays it out."""
        if args is not None and self.fn is not None and not nnx_steps.holds_nnx(args):
            flat = jax.tree_util.tree_flatten(args)
            key = _cache_key(*flat)
            if key not in self._cache:
                self._cache[key] = self._compile(self.fn, args)
            program = self._cache[key]
        else:
            program = self._last
        shardings = None if program is None else checkpoint.state_shardings(program.step, like, argnum)
        if shardings is None:
            shardings = checkpoint.even_shardings(like, self.device_mesh)
        return checkpoint.restore(directory, like, step=step, shardings=shardings)


parallelize.__signature__ = options_signature(parallelize, PARALLELIZE_DEFAULTS)  # type: ignore[attr-defined]

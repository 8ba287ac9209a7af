"""Every planning option, as one frozen object: ``PlanOptions``.

``autoshard.plan``, ``@autoshard.parallelize`` and the CLI's ``plan`` and ``compare`` share it. Each option,
its default, its check and its documentation are written here once: the keyword arguments of ``plan`` and
``parallelize`` are a spelling of it (``PlanOptions.of``: ``plan(step, state, batch, mesh="2x4",
microbatches=4)`` is ``plan(step, state, batch, options=PlanOptions(mesh="2x4", microbatches=4))``), and
their signatures are built from its fields (``signature``), so that ``help`` and an IDE still list them.

What the passes take is derived from it, never assembled again beside it: the ``Target`` (``target``),
the ``PipelineOptions`` with the pipeline runtime's fields (``pipeline_options``), and the input roles with
``batch_argnums`` folded in (``input_roles``).

Two options have no one default: ``mesh`` and ``hardware`` are None, "the entry point's default", since
``plan`` prices a cluster that need not be present (``PLAN_DEFAULTS``: 8 devices on one axis, H100s) and
``parallelize`` runs on the devices present (``PARALLELIZE_DEFAULTS``: all of them, their own preset).
"""

import dataclasses
import difflib
import inspect
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field
from numbers import Integral
from typing import Any, Literal

from autoshard.planner.recompute import check_recompute
from autoshard.target import (
    RUNTIMES,
    BudgetLike,
    HardwareLike,
    MeshLike,
    PipelineOptions,
    PlanningError,
    Target,
    check_time_budget,
    memory_budget_of,
    parse_mesh,
    runtime_options,
)
from autoshard.trace.roles import with_batch_argnums
from cost_models import CostModel

# the choices, as types an IDE and a type checker read (tests/test_options.py ties each to the tuple the
# passes check against: ``target.SCHEDULES``, ``planner.recompute.RECOMPUTE_CHOICES``, ``target.RUNTIMES``)
Schedule = Literal["auto", "1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zb-v"]
Recompute = Literal["auto", "none", "selective", "full"]
Runtime = Literal["auto", "spmd", "mpmd"]

# the entry points' defaults for the options whose field default is None
PLAN_DEFAULTS: Mapping[str, Any] = {"mesh": (8,), "hardware": "h100"}  # autoshard.plan and the CLI
PARALLELIZE_DEFAULTS: Mapping[str, Any] = {"mesh": None, "hardware": "auto"}  # the devices present


class UnknownOption(PlanningError, TypeError):
    """A keyword that is no ``PlanOptions`` field (a TypeError too, as Python's own for a bad keyword)."""


def _doc(text: str) -> dict[str, str]:
    """A field's documentation, kept in its metadata where ``PlanOptions.doc`` and ``help(PlanOptions)``
    read it."""
    return {"doc": " ".join(text.split())}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class PlanOptions:
    """What to plan for and how: every option of ``autoshard.plan``, ``@autoshard.parallelize`` and the
    CLI, checked when made (a ``PlanningError`` naming the option, what it takes and what to try).

    Give it whole (``options=PlanOptions(...)``), as keywords, or both (the keywords replace those fields).
    Frozen and hashable: ``dataclasses.replace`` makes a variant. Each field's documentation follows
    (``PlanOptions.doc(name)``)."""

    mesh: MeshLike | None = field(default=None, metadata=_doc("""
        The logical mesh: a shape (``"8x8"``, ``(2, 4)``), named axes (``{"data": 2, "model": 4}``) or a JAX
        mesh (``jax.make_mesh``; ``plan`` also takes an ``AbstractMesh``). None: the entry point's default,
        ``(8,)`` for ``plan`` and the CLI, all the devices present on one axis for ``parallelize``. No devices
        are needed to plan; ``parallelize`` runs on the first devices present (a ``jax.sharding.Mesh`` on its
        own devices, a subset of them too, with its axis names). Shapes are kept as a tuple of sizes."""))
    hardware: HardwareLike | None = field(default=None, metadata=_doc("""
        What the mesh's devices are priced as: a preset name (h100, h200, a100, v100, tpu-v4, tpu-v5e,
        tpu-v5p, cpu), a profile file (``autoshard profile -o``), ``"auto"`` (the preset of the devices JAX
        sees) or a ``CostModel``. None: the entry point's default, ``"h100"`` for ``plan`` and the CLI,
        ``"auto"`` for ``parallelize``."""))
    memory_budget: BudgetLike = field(default="auto", metadata=_doc("""
        Bytes per device: ``"auto"`` (the default: the hardware's capacity less 10%, for XLA's temporaries),
        a number, a string with a unit (``"80GiB"``, ``"16e9"``, ``"512MB"``), or None / ``"none"`` for no
        limit."""))
    time_budget_s: float | None = field(default=None, metadata=_doc("""
        Wall-clock seconds for the whole planning call, tracing included; the solver returns its best plan
        when they run out, and the log and the plan's ``solver.cut_short`` say what was cut short. None (the
        default): scaled to the step, from a few seconds for a small model to a minute for a large one.
        Progress is logged to the ``"autoshard"`` logger at INFO."""))
    roles: Mapping[str | int, str] | None = field(default=None, metadata=_doc("""
        Input roles (parameter, optimizer state, carried state, batch) are read off what the step does with
        each leaf (``trace.roles``); this overrides them by path prefix or argument position, e.g.
        ``{"state.params": "param", 1: "batch"}``."""))
    batch_argnums: int | tuple[int, ...] | None = field(default=None, metadata=_doc("""
        Arguments (positions) that are the batch, whole; ``roles`` keeps the last word on a leaf it names."""))
    recompute: Recompute = field(default="auto", metadata=_doc("""
        Rematerialise the step's repeated blocks in the backward pass (``planner.recompute``): ``"auto"`` (the
        default) only when no layout fits without it (selective first, then full); ``"none"``, ``"selective"``
        or ``"full"`` fix it. The plan says which (``Plan.recompute``) and ``parallelize`` emits it so; the
        model is not edited. Pipelines recompute alike (``pipeline.recompute``: the microbatch trace
        rewritten, each block's replay in its stage's backward program); ``"auto"`` only when no cut into
        stages fits without, and then per stage where the MPMD runtime runs it: the first stages (the most
        microbatches in flight) recompute, the last ones may not (``pipeline.stages``' recompute per
        stage)."""))
    unroll_scans: bool = field(default=True, metadata=_doc("""
        Unroll a layer stack written as one scan (``nn.scan``, ``jax.lax.scan`` over stacked weights:
        ``trace.unroll``) into its layers before planning, and emit the step so, as if its layers had been
        written as a loop of modules (the default: True). XLA then fuses across each layer's forward and
        backward pass, where a scan must write every value it keeps for the backward pass into a stacked
        buffer: on one H200, GPT-350M and GPT-1.3B written with ``nn.scan`` ran 1.68x and 1.50x slower and
        held 1.49x and 1.46x the memory of the same models unrolled (``benchmarks/gpu_issue46_results.md``).
        False keeps the scan (a shorter compile for a deep stack), priced as a scan. The plan says which
        (``Plan.unrolled``); a pipeline unrolls the stack whatever this says (its stages hold whole
        layers)."""))
    runtime: Runtime = field(default="auto", metadata=_doc("""
        How a pipelined plan runs, and so how it is planned and priced: ``"spmd"`` as one program over a stage
        axis (``pipeline.spmd_program``: equal submeshes, the same number of blocks a stage, priced as its
        lockstep ticks run; what runs across processes); ``"mpmd"`` as one program per stage and action
        dispatched from this process (``pipeline.runtime``: any stages, one process, its host issuing every
        stage's programs priced too: ``pipeline.host``); ``"auto"`` (the default) the SPMD program when
        several processes run or the mesh spans more than one host of the hardware (``target.uniform_stages``:
        a cluster runs one process per host, and the MPMD runtime drives every stage from one), else MPMD,
        and the SPMD program too where the MPMD plan's host work is at least ``HOST_SHARE`` of its step, the
        faster kept (``choose.spmd_if_faster``). Decided by ``target.runtime_options`` when planning, in
        ``plan`` and ``parallelize`` alike, and a plan runs on the runtime it was priced for
        (``target.runs_spmd``)."""))
    microbatches: int | None = field(default=None, metadata=_doc("""
        With ``B``, the step is also planned as a pipeline (stages on submeshes, ``B`` microbatches a step)
        and the plan with the lower predicted step time is returned (a ``PipelinePlan`` or a ``Plan``). None
        (the default): a step that does not fit unpipelined as traced (nothing fits, or only with recompute)
        is also pipelined with a count the planner picks (``pipeline.microbatches``: powers of two dividing
        the batch, each planned, the fastest kept), and the faster plan is returned; with ``time_budget_s``,
        that search runs on what the intra-operator plan left of the budget, and not at all when under
        ``SHARES.min_solve`` of it is left. Such a pipeline, when its stages are uniform and the schedule is
        "auto", is also priced interleaved on stages twice as large over half as many microbatches
        (``pipeline.microbatches.interleaving``: Megatron's layout for GPT-1T), and the faster kept."""))
    pipeline: bool | None = field(default=None, metadata=_doc("""
        True always returns the pipelined plan (it needs ``microbatches``), False never plans one, None (the
        default) returns the faster."""))
    schedule: Schedule = field(default="auto", metadata=_doc("""
        The pipeline's schedule: ``"auto"`` (the default: 1F1B or ZB-H1, whichever the planner prices faster
        on the stages it cuts, and ZB-V for the SPMD program), ``"1f1b"``, ``"gpipe"``, ``"zb-h1"``
        (zero-bubble H1: each backward split into the input-gradient part other stages wait for and a
        weight-gradient part run in the bubbles), ``"interleaved-1f1b"`` (``num_chunks`` model chunks per
        stage; needs ``stage_shape``) or ``"zb-v"`` (zero-bubble V: two chunks a stage in a V, 1F1B's
        activation memory; the SPMD program only)."""))
    num_chunks: int = field(default=2, metadata=_doc("""
        Model chunks per stage of an interleaved schedule (the default: 2)."""))
    num_layers: int | None = field(default=None, metadata=_doc("""
        Layers the pipeline planner cuts the step into (default: one per named block, plus one)."""))
    max_stages: int | None = field(default=None, metadata=_doc("""
        At most this many pipeline stages (default: as many as the stage DP finds best)."""))
    stage_shape: tuple[int, int] | None = field(default=None, metadata=_doc("""
        ``(hosts, devices)``: every stage's submesh fixed to that shape (default: the stage DP picks each
        stage's submesh)."""))

    def __post_init__(self) -> None:
        """Every option checked here, once, whichever entry point made it (nothing that needs a device:
        ``"auto"`` hardware and ``parallelize``'s default mesh are resolved by ``target``); sequences kept as
        tuples and mappings copied, so that options compare and hash by value."""
        if self.mesh is not None:
            shape, names = parse_mesh(self.mesh)
            if isinstance(self.mesh, Mapping):
                _set(self, "mesh", dict(zip(names, shape, strict=True)))
            elif isinstance(self.mesh, str | Sequence):
                _set(self, "mesh", shape)
        if not (self.hardware is None or isinstance(self.hardware, str | os.PathLike | CostModel)):
            raise PlanningError(f"hardware={self.hardware!r}: expected a preset name (h100, a100, tpu-v5p, ...), a "
                                "profile file, 'auto' (the devices JAX sees) or a cost_models.CostModel")
        memory_budget_of(self.memory_budget, 1.0)  # its form only: the capacity is the hardware's (``target``)
        check_time_budget(self.time_budget_s)
        if self.roles is not None:
            if not isinstance(self.roles, Mapping):
                raise PlanningError(f"roles={self.roles!r}: expected a mapping from a path prefix or an argument "
                                    "position to a role, e.g. {'state.params': 'param', 1: 'batch'}")
            _set(self, "roles", dict(self.roles))
        if self.batch_argnums is not None and not isinstance(self.batch_argnums, int):
            if not isinstance(self.batch_argnums, Sequence) or isinstance(self.batch_argnums, str):
                raise PlanningError(f"batch_argnums={self.batch_argnums!r}: expected an argument position or a "
                                    "tuple of them, e.g. 1 or (1, 2)")
            _set(self, "batch_argnums", tuple(self.batch_argnums))
        with_batch_argnums(None, self.batch_argnums)  # positions: ints from 0
        check_recompute(self.recompute)
        if self.runtime not in RUNTIMES:
            raise PlanningError(f"runtime={self.runtime!r} is not one of {', '.join(RUNTIMES)} ('auto' plans for "
                                "the program that runs the mesh: see PlanOptions.doc('runtime'))")
        if self.stage_shape is not None:
            shape = tuple(self.stage_shape) if isinstance(self.stage_shape, Sequence) else ()
            if len(shape) != 2 or any(isinstance(s, bool) or not isinstance(s, Integral) or s < 1 for s in shape):
                raise PlanningError(f"stage_shape={self.stage_shape!r}: give (hosts, devices) of every stage's "
                                    "submesh, e.g. (1, 4), or None to let the planner pick")
            _set(self, "stage_shape", tuple(int(s) for s in shape))
        if not isinstance(self.unroll_scans, bool):
            raise PlanningError(f"unroll_scans={self.unroll_scans!r}: give True (a layer stack written as one scan "
                                "is planned and emitted unrolled) or False (kept a scan)")
        if self.pipeline is not None and not isinstance(self.pipeline, bool):
            raise PlanningError(f"pipeline={self.pipeline!r}: give True (always the pipelined plan), False (never "
                                "one) or None (the faster)")
        self._pipeline()  # microbatches, pipeline, schedule, num_chunks, num_layers, max_stages: its checks

    # ---- one spelling ------------------------------------------------------------------------------------

    @classmethod
    def of(cls, options: "PlanOptions | None" = None, /, **kwargs: Any) -> "PlanOptions":
        """``options`` with the fields ``kwargs`` name replaced (all defaults when ``options`` is None): how
        ``plan`` and ``parallelize`` read their keywords. A keyword that is no field is refused, naming the
        closest one."""
        for name in kwargs:
            if name not in FIELDS:
                close = difflib.get_close_matches(name, FIELDS, n=1, cutoff=0.5)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise UnknownOption(f"unknown planning option {name!r}: {hint}the options are autoshard.PlanOptions' "
                                    f"fields: {', '.join(FIELDS)}")
        if options is None:
            return cls(**kwargs)
        if not isinstance(options, PlanOptions):
            raise PlanningError(f"options={options!r} ({type(options).__name__}): expected an autoshard.PlanOptions, "
                                "or give the options as keywords")
        return dataclasses.replace(options, **kwargs) if kwargs else options

    @classmethod
    def doc(cls, name: str) -> str:
        """The documentation of the field ``name``."""
        for f in dataclasses.fields(cls):
            if f.name == name:
                return f.metadata["doc"]
        raise UnknownOption(f"PlanOptions has no field {name!r}; its fields: {', '.join(FIELDS)}")

    # ---- what the passes take ----------------------------------------------------------------------------

    def target(self, defaults: Mapping[str, Any] = PLAN_DEFAULTS) -> Target:
        """The ``Target`` (mesh, hardware, memory budget) resolved, ``defaults`` (the entry point's:
        ``PLAN_DEFAULTS``, ``PARALLELIZE_DEFAULTS``) standing in for a mesh or hardware left None."""
        mesh = self.mesh if self.mesh is not None else defaults["mesh"]
        if mesh is None:
            raise PlanningError("no mesh to plan for: give mesh=, e.g. (2, 4), '8x8' or {'data': 2, 'model': 4}")
        hardware = self.hardware if self.hardware is not None else defaults["hardware"]
        return Target.of(mesh, hardware, self.memory_budget)

    def pipeline_options(self, target: Target, processes: int = 1) -> PipelineOptions:
        """The pipeline's options on ``target`` run by ``processes`` processes, the runtime's fields
        (``uniform``, ``spmd_if_faster``) decided by ``target.runtime_options``."""
        return dataclasses.replace(self._pipeline(), **runtime_options(self.runtime, target, processes,
                                                                      schedule=self.schedule))

    def input_roles(self) -> dict[str | int, Any] | None:
        """``roles`` with every argument of ``batch_argnums`` marked the batch, as ``trace`` takes them."""
        return with_batch_argnums(self.roles, self.batch_argnums)

    def _pipeline(self) -> PipelineOptions:
        return PipelineOptions(microbatches=self.microbatches, pipeline=self.pipeline, schedule=self.schedule,
                               num_chunks=self.num_chunks, num_layers=self.num_layers, max_stages=self.max_stages,
                               stage_shape=self.stage_shape)

    # ---- value semantics ---------------------------------------------------------------------------------

    def _key(self) -> tuple[Any, ...]:
        # mappings by their items in order (a mesh's axes are ordered); a value that cannot be hashed (a
        # CostModel holding tables) hashes by its type and compares by its own ``==``
        return tuple(tuple(v.items()) if isinstance(v, Mapping) else v
                     for v in (getattr(self, f) for f in FIELDS))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PlanOptions):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(tuple(_hashable(v) for v in self._key()))


def _set(options: PlanOptions, name: str, value: Any) -> None:
    object.__setattr__(options, name, value)  # a frozen dataclass normalising its own fields


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return type(value).__name__
    return value


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PlanOptions))
PlanOptions.__doc__ = (PlanOptions.__doc__ or "") + "\n\n" + "\n\n".join(  # for help(PlanOptions)
    textwrap.fill(f"``{f.name}``: {f.metadata['doc']}", 106, initial_indent="    ", subsequent_indent="    ")
    for f in dataclasses.fields(PlanOptions))


def signature(fn: Callable[..., Any], defaults: Mapping[str, Any] = PLAN_DEFAULTS) -> inspect.Signature:
    """``fn``'s signature with its ``**kwargs`` spelled out as ``PlanOptions``' fields (keyword-only, their
    defaults as the entry point has them: ``defaults``), for ``help()`` and IDEs to list: the entry points
    take them as ``**kwargs`` (``PlanOptions.of``) so that they are written once, here."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=defaults.get(f.name, f.default),
                                 annotation=f.type) for f in dataclasses.fields(PlanOptions)]
    return sig.replace(parameters=params)

"""A pipelined plan for a person: ``format_pipeline_plan`` (stages, submeshes, time and memory per stage,
the bubble) and ``explain_pipeline`` (that, with the step time split into stage work, bubble and update)."""

from __future__ import annotations

from collections.abc import Iterable

from autoshard.pipeline.draws import RAW, row_draws
from autoshard.pipeline.partition import UPDATE, split_step
from autoshard.pipeline.pipeline_plan import PipelinePlan
from autoshard.planner.summary import cpu_note, human_time, mfu_line
from autoshard.trace import Graph, remat
from autoshard.trace.graph import Op
from autoshard.trace.summary import human_bytes
from solvers.pipeline.schedules import V_SCHEDULES


def one_stage_note(plan: PipelinePlan) -> str | None:
    """For a pipelined plan of one stage, what it is, why, and how to force stages; else None. A pipeline
    asked for (``pipeline=True``) and answered with one stage is microbatch accumulation over the whole
    mesh, which a user reading "pipeline" would not expect (a Llama-style model of 4 blocks on 2x4 CPU
    devices: one stage, 2.1x slower than ``jax.jit``)."""
    if len(plan.stages) != 1:
        return None
    hosts, devices = plan.cluster
    shape = (hosts // 2, devices) if hosts % 2 == 0 else (hosts, devices // 2) if devices % 2 == 0 else None
    force = (f"give stage_shape={shape} (--stage-shape {shape[0]}x{shape[1]}) for 2 stages, or any other "
             "submesh shape" if shape is not None else "give stage_shape=(hosts, devices) (--stage-shape HxD)")
    why = ("the step was cut into one layer" if plan.num_layers == 1 else
           f"no cut of its {plan.num_layers} layers into stages, on the submesh shapes and stage counts allowed, "
           "priced faster on this cost model")
    return ("one stage: the microbatches run one after another on the whole mesh (gradient accumulation, no "
            f"pipeline), because {why}. "
            f"To force stages, {force}; the intra-operator plan (microbatches=None, pipeline left to the "
            "planner) is usually faster than one stage.")


RANDOM_PRIMITIVES = frozenset({"random_bits", *RAW})  # the draws of jax.random (dropout, sampling)


def random_note(micro: Graph, full: Graph, num_microbatches: int) -> str | None:
    """For a step traced at microbatch size (``micro``; ``full`` at full size) that draws random numbers from a key
    it is given (dropout) in a way a pipeline cannot draw as jax.jit does, what each microbatch draws; else None.
    Both runtimes draw each microbatch's rows of jax.jit's numbers where ``draws.row_draws`` finds which draws
    run over the batch's rows (threefry keys, partitionable, dimension 0 the batch's); left: every microbatch
    runs the step with the key it is given and draws the first microbatch's numbers (a dropout model
    pipelined over 4 microbatches on 2x4: loss 6.4805 against jax.jit's 6.4780)."""
    def draws(ops: Iterable[Op]) -> bool:
        return any(op.primitive in RANDOM_PRIMITIVES or any(draws(b.ops) for b in op.bodies) for op in ops)

    if row_draws(micro, full, num_microbatches) is not None:
        return None  # every draw is jit's: over the rows, each microbatch's; the others the same for all
    kind = split_step(micro).kind  # draws in the update (noise on the gradients) run once a step, as jit's
    if not draws(op for op in micro.ops if kind[op.id] != UPDATE):
        return None
    keys = [t.name for t in (micro.tensors[i] for i in micro.inputs) if t.dtype.startswith("key<")]
    given = f"the key{'s' if len(keys) > 1 else ''} {', '.join(keys)}" if keys else "a key it is given"
    return (f"the step draws random numbers (jax.random, e.g. dropout) from {given} in a way a pipeline cannot "
            "draw as jax.jit does (that needs threefry keys, jax's default, with jax_threefry_partitionable on, "
            "its default, one key a draw, and every draw's dimension 0 the batch's rows or of the same shape "
            "for the whole batch): it runs the step once a microbatch with that same key, so every microbatch "
            "draws the same numbers (the same dropout mask on each microbatch's rows). Where it matters, plan "
            "without microbatches (the intra-operator plan draws as jax.jit does).")


def format_pipeline_plan(plan: PipelinePlan) -> str:
    """Stages, their submeshes, per-stage time and memory, and the bubble."""
    S = len(plan.stages)
    priced = plan.solver.schedules
    others = [f"{name} {human_time(t)}" for name, t in (priced or {}).items() if name != plan.schedule]
    chosen = f" (the faster for these stages; microbatches' passes {human_time(priced[plan.schedule])}, " \
        f"{', '.join(others)})" if priced and plan.schedule in priced and others else ""
    per_stage = any(st.recompute for st in plan.stages)
    v_shape = plan.schedule in V_SCHEDULES  # the last virtual stage on stage 0, beside the head
    lines = [
        f"mesh {plan.mesh}   hardware {plan.hardware or '?'}",
        *([cpu] if (cpu := cpu_note(plan.mesh, plan.hardware)) else []),
        f"pipeline: {S} stage{'s' if S != 1 else ''}"
        + (f" ({plan.num_physical_stages} of {plan.num_chunks} chunks each)" if plan.num_chunks > 1 else "")
        + f", {plan.num_microbatches} microbatches, schedule "
        f"{plan.schedule}{chosen}, {plan.num_layers} layers",
        *([note] if (note := one_stage_note(plan)) else []),
        "runs as one SPMD program over a stage axis (any number of processes; lockstep ticks priced)" if plan.spmd
        else "runs a program per stage from one process (the MPMD runtime; one host)"
        + (f": {human_time(plan.host_time)} of host work a step issuing them" if plan.host_time else ""),
        *([f"the layers after the last block ({human_time(plan.tail_time)} a microbatch on "
           + ("stage 0, beside the head" if v_shape else "the last stage")
           + f") run on the {'first' if v_shape else 'last'} {plan.tail_split} stages, 1/{plan.tail_split} of each "
           "microbatch's rows each, in the tick after its last forward"] if plan.tail_split > 1 else []),
        f"predicted step time {human_time(plan.predicted_step_time)}   bubble {100 * plan.bubble_fraction:.1f}%   "
        f"peak memory per device {human_bytes(plan.peak_memory)}"
        + (f" of a {human_bytes(plan.memory_budget)} budget" if plan.memory_budget else " (no budget)"),
        *([mfu_line(plan.mfu, plan.model_flops)] if plan.mfu is not None else []),
        *([f"recompute: {remat.summary(plan.recompute)} (replayed in each stage's backward program; counted in "
           f"its time{'; chosen per stage' if per_stage else ''})"] if plan.recompute else []),
        "",
        f"  {'stage':<6}{'layers':<10}{'submesh':<10}{'devices':<16}{'fwd+bwd/microbatch':>20}{'update':>12}"
        f"{'memory/device':>16}" + ("  recompute" if per_stage else ""),
    ]
    cluster = plan.cluster
    for s, st in enumerate(plan.stages):
        devs = st.devices(cluster)
        dev = f"{devs[0]}..{devs[-1]}" if len(devs) > 1 else str(devs[0])
        lines.append(f"  {s:<6}{f'{st.layers[0]}..{st.layers[1]}':<10}{f'{st.submesh[0]}x{st.submesh[1]}':<10}"
                     f"{dev:<16}{human_time(st.micro_time):>20}{human_time(st.update_time):>12}{human_bytes(st.memory):>16}"
                     + (f"  {st.recompute}" if per_stage else ""))
    sv = plan.solver
    lines += ["", f"planner: {sv.distinct_layers} distinct layers priced on each submesh shape "
              f"({sv.layer_solves} intra-op solves), stage DP {sv.dp_seconds:.2f} s, "
              f"total {sv.planning_seconds:.1f} s"]
    if sv.cut_short:
        lines.append(f"time budget: {sv.cut_short}")
    return "\n".join(lines)


def explain_pipeline(plan: PipelinePlan) -> str:
    """The pipeline plan's summary, with the step time split into stage work, bubble and update."""
    times = [st.micro_time for st in plan.stages]
    B, V = plan.num_microbatches, len(plan.stages)
    S = V // max(1, plan.num_chunks)  # physical stages; a stage runs its chunks
    work = sum(times) * B / S if S else 0.0
    # once per step, each physical stage its chunks' updates; the rest of the step is the schedule's passes
    update = max((sum(plan.stages[u].update_time for u in range(V) if plan.place(u)[0] == s) for s in range(S)),
                 default=0.0)
    pipe = plan.predicted_step_time - update
    total = plan.predicted_step_time or 1.0
    # the stages' own timeline (its idle fraction is the bubble); what the step adds to it, the host issuing
    # the MPMD runtime's programs where that bounds the step (``pipeline.host``)
    timeline = work / (1.0 - plan.bubble_fraction) if plan.host_time and plan.bubble_fraction < 1 else pipe
    host = max(pipe - timeline, 0.0)
    rows = [("stage work (mean per stage)", work), ("pipeline bubble", pipe - host - work),
            *([("host issuing the programs", host)] if host > 0 else []), ("update (slowest stage)", update)]
    lines = [format_pipeline_plan(plan), "", "time by category (adds up to the step time)"]
    for k, v in rows:
        lines.append(f"  {k:<28} {human_time(v):>12}  {100 * v / total:5.1f}%")
    runs = "its slots are the SPMD program's lockstep ticks" if plan.spmd else "each stage follows its row's order"
    lines += ["", f"the program both runtimes run (PipelinePlan.program; {runs}):",
              *("  " + row for row in plan.program.draw(max_slots=DRAWN_SLOTS, max_stages=DRAWN_STAGES).splitlines())]
    return "\n".join(lines)


DRAWN_SLOTS, DRAWN_STAGES = 36, 8  # the window of a plan's program that ``explain`` draws

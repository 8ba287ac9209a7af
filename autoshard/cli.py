"""The ``autoshard`` command line.

Each subcommand is one entry in ``_COMMANDS``: a function that adds its arguments to a parser and a
function that runs it. Subcommands import their heavy dependencies (JAX) lazily, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autoshard._examples import Example
    from autoshard.megatron import GridPoint
    from autoshard.options import PlanOptions
    from autoshard.pipeline import PipelinePlan
    from autoshard.planner.plan import Plan
    from autoshard.target import Target
    from autoshard.trace import Graph


@dataclass(frozen=True, slots=True)
class _Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _add_example_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a model file following the examples/ convention, e.g. examples/gpt.py")
    p.add_argument("--preset", default="tiny", help="size preset from the file's PRESETS (default: tiny)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one field of the preset's config, e.g. --set scan_layers=true (repeatable)",
    )
    p.add_argument(
        "--concrete",
        action="store_true",
        help="build real arrays instead of abstract shapes (abstract is the default: nothing is allocated)",
    )


def _trace_arguments(p: argparse.ArgumentParser) -> None:
    _add_example_arguments(p)
    p.add_argument("--top", type=int, default=10, help="how many of the largest tensors to list")
    p.add_argument("--json", metavar="PATH", help="also write the graph's summary statistics as JSON")


def _trace_run(args: argparse.Namespace) -> int:
    import json
    import time

    from autoshard._examples import load_example
    from autoshard.trace import trace

    example = load_example(args.model, args.preset, args.overrides, abstract=not args.concrete)
    t0 = time.perf_counter()
    graph = trace(example.train_step, *example.args)
    elapsed = time.perf_counter() - t0
    graph.verify()
    print(f"{example.name} preset={example.preset} traced in {elapsed:.2f} s")
    print(graph.summary(top=args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(graph.stats() | {"trace_seconds": elapsed}, f, indent=2)
    return 0


def _profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default="2x4", help="mesh shape to measure collectives on, e.g. 2x4 (default)")
    p.add_argument("--axis-names", help="comma-separated mesh axis names (default x,y,...)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (~1 min on 8 CPU devices)")
    p.add_argument("--repeats", type=int, help="timed runs per measurement (the median is kept)")
    p.add_argument("--estimator", choices=("median", "min"), default="median", help="how repeats are reduced")
    p.add_argument("--cpu-devices", type=int, default=8, help="CPU devices to ask JAX for (default 8)")
    p.add_argument("-o", "--output", metavar="PATH", help="write the profile JSON here")


def _profile_run(args: argparse.Namespace) -> int:
    from autoshard.profiler import ProfileConfig, ensure_cpu_devices, run_profile
    from autoshard.target import parse_mesh

    ensure_cpu_devices(args.cpu_devices)  # before any JAX operation initialises the backends
    shape, axis_names = parse_mesh(args.mesh, args.axis_names.split(",") if args.axis_names else None)
    names = axis_names if args.axis_names else None
    config = (ProfileConfig.quick if args.quick else ProfileConfig)(
        mesh_shape=shape, axis_names=names, estimator=args.estimator
    )
    if args.repeats:
        from dataclasses import replace

        config = replace(config, repeats=args.repeats)
    profile = run_profile(config, log=print)
    print(f"profiled in {profile.environment['seconds']} s; fitted {profile.cluster.device}")
    print(f"links: {profile.cluster.intra_link}, {profile.cluster.inter_link}")
    if args.output:
        profile.save(args.output)
        print(f"wrote {args.output}")
    return 0


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: give a positive, finite number of seconds (e.g. 30); the solver "
                                         "returns its best plan when the time is up")
    return value


def _count(text: str) -> int:
    """A whole number >= 1 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: give a whole number >= 1")
    return value


def _stage_shape(text: str | None) -> tuple[int, int] | None:
    """``--stage-shape 1x4`` -> (1, 4)."""
    if text is None:
        return None
    from autoshard.target import parse_mesh

    shape, _ = parse_mesh(text)
    if len(shape) != 2:
        from autoshard.target import PlanningError

        raise PlanningError(f"--stage-shape {text!r}: give hosts x devices, e.g. 1x4")
    return (shape[0], shape[1])


MEGATRON_SECONDS = 30.0  # compare --megatron: seconds per plan of the grid when --time-budget is not given


def _add_mesh_arguments(p: argparse.ArgumentParser, *, time_budget: float | None, per_plan: bool = False) -> None:
    """The logical mesh, hardware and budgets, as ``plan`` and ``compare`` take them."""
    # no default here for the mesh and the hardware: None is `plan`'s own (``options.PLAN_DEFAULTS``)
    p.add_argument("--mesh", help="logical mesh shape, e.g. 8 (the default), 2x4, 8x8 (no devices needed)")
    p.add_argument("--axes", help="comma-separated mesh axis names (default x, y, z)")
    p.add_argument("--hardware",
                   help="hardware preset (h100, the default, h200, a100, v100, tpu-v4, tpu-v5e, tpu-v5p, cpu) or "
                        "profile JSON")
    p.add_argument("--memory-budget", default="auto",
                   help="bytes per device ('16e9', '80GiB', '512MB'), 'auto' (capacity less 10%%) or 'none'")
    p.add_argument("--time-budget", type=_seconds, default=time_budget,
                   help=("seconds for the whole comparison, shared by the plans it makes (default: scaled to the "
                         "step, the time `plan` gives one plan times the plans, printed first); with --megatron, "
                         f"seconds per plan (default {MEGATRON_SECONDS:.0f})" if per_plan else
                         "wall-clock seconds for tracing, building and solving (default: scaled to the model)"))
    p.add_argument("--keep-scans", action="store_true",
                   help="plan a layer stack written as one scan (nn.scan) as the scan: a shorter compile, priced "
                        "as a scan (default: unrolled into its layers, planned and run so, which XLA runs faster)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


_PIPELINE = {"auto": None, "yes": True, "no": False}  # --pipeline -> PlanOptions.pipeline


def _plan_options(args: argparse.Namespace, **fields: Any) -> PlanOptions:
    """The ``PlanOptions`` the command's flags spell: the one place argparse meets ``autoshard.plan``'s
    options. ``--mesh`` with ``--axes`` (named axes), ``--hardware``, ``--memory-budget``, ``--time-budget``
    and ``--runtime``, which ``plan`` and ``compare`` share, and ``plan``'s pipeline and recompute flags;
    ``fields``: what a command spells its own way (``compare``'s one ``--recompute`` mode)."""
    from autoshard.options import PLAN_DEFAULTS, PlanOptions
    from autoshard.target import parse_mesh

    mesh: Any = args.mesh
    if args.axes:
        shape, names = parse_mesh(args.mesh or PLAN_DEFAULTS["mesh"], [a.strip() for a in args.axes.split(",")])
        mesh = dict(zip(names, shape, strict=True))
    spelled: dict[str, Any] = {"mesh": mesh, "hardware": args.hardware, "memory_budget": args.memory_budget,
                               "time_budget_s": args.time_budget, "runtime": args.runtime,
                               "unroll_scans": not args.keep_scans}
    if args.command == "plan":
        spelled |= {"microbatches": args.microbatches, "pipeline": _PIPELINE[args.pipeline],
                    "schedule": args.schedule, "num_chunks": args.chunks, "num_layers": args.layers,
                    "max_stages": args.max_stages, "stage_shape": _stage_shape(args.stage_shape),
                    "recompute": args.recompute}
    return PlanOptions(**spelled | fields)


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    _add_example_arguments(p)
    _add_mesh_arguments(p, time_budget=None)
    p.add_argument("-o", "--output", metavar="PATH", help="write the plan as JSON")
    p.add_argument("--microbatches", type=_count, metavar="B",
                   help="also plan a pipeline with B microbatches; the faster plan wins (see --pipeline)")
    p.add_argument("--pipeline", choices=["auto", "yes", "no"], default="auto",
                   help="with --microbatches: 'yes' forces the pipelined plan, 'no' the intra-operator one")
    p.add_argument("--schedule", default="auto", choices=["auto", "1f1b", "gpipe", "zb-h1", "interleaved-1f1b", "zb-v"],
                   help="pipeline schedule (auto: 1f1b or zb-h1, whichever the planner prices faster, and zb-v "
                   "too for the SPMD program; interleaved-1f1b needs --stage-shape; --chunks per stage; zb-v: "
                   "two chunks a stage in a V, the SPMD program only)")
    p.add_argument("--chunks", type=_count, default=2, metavar="V", help="model chunks per stage (interleaved)")
    p.add_argument("--stage-shape", metavar="HxD", help="every stage on a submesh of H hosts x D devices")
    p.add_argument("--layers", type=_count, metavar="L", help="layers the pipeline planner cuts the model into")
    p.add_argument("--max-stages", type=_count, metavar="S", help="at most S pipeline stages")
    p.add_argument("--recompute", default="auto", choices=["auto", "none", "selective", "full"],
                   help="rematerialise the repeated blocks' activations in the backward pass: 'auto' (default) "
                        "only when the step does not fit without it")
    p.add_argument("--runtime", default="auto", choices=["auto", "spmd", "mpmd"],
                   help="how a pipeline runs: 'spmd' one program over a stage axis (uniform stages, any number of "
                        "processes), 'mpmd' a program per stage from one process (any stages), 'auto' (default) "
                        "SPMD when the mesh spans more than one host of the hardware, or where the MPMD runtime's "
                        "host work makes it the faster")


def _plan_run(args: argparse.Namespace) -> int:
    import time

    from autoshard import api
    from autoshard._examples import load_example
    from autoshard.pipeline import format_pipeline_plan
    from autoshard.planner.plan import Plan
    from autoshard.planner.summary import format_plan

    options = _plan_options(args)
    example = load_example(args.model, args.preset, args.overrides, abstract=not args.concrete)
    t0 = time.perf_counter()
    the_plan = api.plan(example.train_step, *example.args, options=options)
    elapsed = time.perf_counter() - t0
    print(f"{example.name} preset={example.preset} planned in {elapsed:.1f} s (trace, build, solve)")
    if isinstance(the_plan, Plan):
        print(format_plan(the_plan))
        other = the_plan.solver.pipeline_step_time
        if other is not None:
            print(f"(the best pipelined plan predicts {other * 1e3:.2f} ms: intra-operator only is faster)")
    else:
        print(format_pipeline_plan(the_plan))
        other = the_plan.solver.intra_op_step_time
        if isinstance(other, float):
            print(f"(the best intra-operator plan predicts {other * 1e3:.2f} ms)")
        elif other is not None:
            print(f"(intra-operator: {other})")
    if args.output:
        the_plan.save(args.output)
        print(f"plan written to {args.output}")
    return 0


def _explain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="a plan JSON written by `autoshard plan -o`")
    p.add_argument("--graph", metavar="MODEL", help="the model file the plan was made for (needed for --why)")
    p.add_argument("--preset", default="tiny", help="with --graph: the preset the plan was made for")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="with --graph: the preset overrides the plan was made for (repeatable)")
    p.add_argument("--why", action="append", default=[], metavar="TENSOR",
                   help="why does this tensor have its layout: each alternative and its cost (repeatable; "
                        "needs --graph)")
    p.add_argument("--resolve", action="store_true",
                   help="with --why: also re-solve the whole step with each alternative forced")
    p.add_argument("--top", type=int, default=10, help="how many op groups to list where the time goes")
    p.add_argument("--json", metavar="PATH", help="also write the explanation as JSON")


def _explain_run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from autoshard.pipeline import PipelinePlan, explain_pipeline
    from autoshard.planner.explain import explain_plan, explain_tensor
    from autoshard.planner.plan import Plan, PlanError

    try:
        data = json.loads(Path(args.plan).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"{args.plan}: cannot read a plan ({e})") from None
    if args.why and not args.graph:
        raise PlanError("--why needs --graph MODEL (and the --preset/--set the plan was made with)")
    if isinstance(data, dict) and data.get("kind") == "pipeline":
        pplan = PipelinePlan.from_dict(data)
        print(explain_pipeline(pplan))
        if args.graph:  # checked against the model: traced at microbatch size, recomputing as the plan does
            _plan_traces(pplan, args)
        if args.why:
            print("(--why answers for intra-operator plans only)")
        return 0
    plan = Plan.load(args.plan)
    explanation = explain_plan(plan, top=args.top)
    print(explanation.text())
    out: dict = {"plan": explanation.to_dict(), "why": []}
    if args.graph:
        graph, _ = _plan_traces(plan, args)  # the step the plan was made for: its recompute applied
        for name in args.why:
            why = explain_tensor(graph, plan, None, name, resolve=args.resolve)
            print()
            print(why.text())
            out["why"].append(why.to_dict())
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


def _plan_traces(plan: Plan | PipelinePlan, args: argparse.Namespace) -> tuple[Graph, Graph | None]:
    """``--graph``'s model traced as ``plan`` runs it (``api.trace_for_plan``: its recompute applied, at
    microbatch size for a pipelined plan) and checked against the plan."""
    from autoshard._examples import load_example
    from autoshard.api import trace_for_plan

    example = load_example(args.graph, args.preset, args.overrides, abstract=True)
    return trace_for_plan(plan, example.train_step, example.args)


def _compare_arguments(p: argparse.ArgumentParser) -> None:
    _add_example_arguments(p)
    _add_mesh_arguments(p, time_budget=None, per_plan=True)
    p.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    p.add_argument("--recompute", nargs="+", choices=["auto", "none", "selective", "full"], metavar="MODE",
                   help="rematerialise the repeated blocks' activations: one of auto (the default: only when the step "
                        "does not fit without it; the hand layouts are then priced recomputing the same way), none, "
                        "selective, full. With --megatron, the settings the grid prices (default: none selective)")
    g = p.add_argument_group("pipelined hand layouts (Megatron's grid)")
    g.add_argument("--megatron", action="store_true",
                   help="price Megatron-style pipelines (stage shape x microbatches x schedule x recompute) beside "
                        "the automatic plan, instead of the intra-operator layouts")
    g.add_argument("--stage-shapes", nargs="+", metavar="HxD",
                   help="stage submeshes (default: one host, half a host, two hosts)")
    g.add_argument("--microbatches", nargs="+", type=_count, default=[64, 128], metavar="B")
    g.add_argument("--schedules", nargs="+", default=["1f1b"], choices=["1f1b", "gpipe", "zb-h1", "interleaved-1f1b"])
    g.add_argument("--chunks", type=_count, default=2, metavar="V", help="model chunks per stage (interleaved)")
    g.add_argument("--no-auto", action="store_true", help="skip the automatic plan")
    g.add_argument("--runtime", default="auto", choices=["auto", "spmd", "mpmd"],
                   help="the pipeline runtime both the automatic plan and the grid are priced for (as for "
                        "`autoshard plan`): 'auto' (default) the SPMD program when the mesh spans hosts")


def _compare_run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from autoshard._examples import load_example
    from autoshard.planner.compare import compare, compare_budget
    from autoshard.trace import trace
    from autoshard.trace.unroll import unroll_layer_stacks

    modes = args.recompute or ["auto"]
    if len(modes) > 1 and not args.megatron:
        from autoshard.target import PlanningError

        raise PlanningError(f"--recompute {' '.join(modes)}: compare prices every layout at one recompute setting; "
                            "give one (auto, the default, recomputes only when the step does not fit without it), "
                            "or add --megatron to price each setting in the grid")
    # the target and the runtime as `plan` reads them; the grid's settings (--megatron) stay its own
    options = _plan_options(args, **({} if args.megatron else {"recompute": modes[0]}))
    target = options.target()
    example = load_example(args.model, args.preset, args.overrides, abstract=True)
    if args.megatron:
        return _megatron_run(args, options, target, example)
    graph = trace(example.train_step, *example.args)
    if options.unroll_scans:  # priced as `plan` plans it
        graph = unroll_layer_stacks(graph, why="as `plan` plans them (--keep-scans keeps the scan)")
    total, plans = compare_budget(graph, target.cost)
    if options.time_budget_s is not None:
        total = options.time_budget_s
    print(f"time budget {total:.0f} s for {plans} plans ({total / plans:.1f} s each"
          f"{'' if options.time_budget_s is not None else ', scaled to the step; --time-budget sets it'})",
          flush=True)
    result = compare(graph, target.cost, hardware=target.hardware, memory_budget=target.memory_budget,
                     total_budget_s=total, recompute=options.recompute,
                     log=lambda m: print(f"  priced {m}", file=sys.stderr, flush=True))
    print(result.text())
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1))
    return 0


def _megatron_run(args: argparse.Namespace, options: PlanOptions, target: Target, example: Example) -> int:
    import json
    from pathlib import Path

    from autoshard.megatron import automatic_plan, grid_table, megatron_grid

    def say(point: GridPoint) -> None:
        if not args.quiet:
            what = f"{point.step_time:.4g} s" if point.plan is not None else point.error
            print(f"  priced {point.name}: {what} ({point.seconds:.0f} s)", file=sys.stderr, flush=True)

    auto, t_auto, sp_auto = (None, 0.0, None) if args.no_auto else automatic_plan(example.train_step, example.args,
                                                                                  target, options.runtime)
    shapes = [_stage_shape(s) for s in args.stage_shapes] if args.stage_shapes else None
    points = megatron_grid(example.train_step, example.args, target, stage_shapes=shapes,
                           microbatches=args.microbatches, recompute=args.recompute or ["none", "selective"],
                           schedules=args.schedules,
                           num_chunks=args.chunks, runtime=options.runtime, log=say,
                           time_budget_s=MEGATRON_SECONDS if options.time_budget_s is None else options.time_budget_s)
    print(grid_table(points, auto, t_auto, sp_auto))
    if args.json:
        rows = [{"stage_shape": p.stage_shape, "microbatches": p.microbatches, "schedule": p.schedule,
                 "recompute": p.recompute, "step_time": None if p.plan is None else p.step_time,
                 "mfu": None if p.plan is None else p.plan.mfu, "error": p.error, "seconds": p.seconds,
                 "sequence_parallel": p.sequence_parallel}
                for p in points]
        auto_row = None if auto is None else {"step_time": auto.predicted_step_time, "mfu": auto.mfu,
                                              "seconds": t_auto, "sequence_parallel": sp_auto}
        Path(args.json).write_text(json.dumps({"automatic": auto_row, "grid": rows}, indent=1))
    return 0


def _cache_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["list", "clear"], help="list the cached plans, or remove them all")
    p.add_argument("--dir", metavar="PATH",
                   help="the cache directory (default: AUTOSHARD_CACHE_DIR, else the user's cache directory)")


def _cache_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from autoshard import cache

    root = Path(args.dir) if args.dir else cache.cache_dir()
    if root is None:
        print("the plan cache is off (AUTOSHARD_CACHE_DIR is 'off'); pass --dir to look at a directory")
        return 0
    if args.action == "clear":
        print(f"removed {cache.clear(root)} cached plan(s) from {root}")
        return 0
    found = list(cache.entries(root))
    print(f"{len(found)} cached plan(s) in {root}")
    for e in found:
        a = e.about
        step = f"{e.predicted_step_time * 1e3:.3g} ms" if e.predicted_step_time is not None else "?"
        options = ", ".join(f"{k}={v}" for k, v in a.get("options", {}).items())
        print(f"  {e.path.stem[:12]}  {a.get('step', '?')} ({a.get('ops', '?')} ops)  mesh {a.get('mesh', '?')} "
              f"on {a.get('hardware', '?')}  {e.kind}, {step} a step  saved {e.saved or '?'}"
              f"{'  ' + options if options else ''}")
    return 0


_COMMANDS: dict[str, _Command] = {
    "plan": _Command(
        help="plan a model's train step on a logical mesh and print the plan",
        add_arguments=_plan_arguments,
        run=_plan_run,
    ),
    "trace": _Command(
        help="trace a model's train step into a graph and print its summary",
        add_arguments=_trace_arguments,
        run=_trace_run,
    ),
    "explain": _Command(
        help="explain a saved plan: layouts per class and layer, time and memory by category, why-questions",
        add_arguments=_explain_arguments,
        run=_explain_run,
    ),
    "compare": _Command(
        help="the automatic plan beside the hand-written dp x tp (x ZeRO) layouts, priced the same way",
        add_arguments=_compare_arguments,
        run=_compare_run,
    ),
    "cache": _Command(
        help="the plans cached across launches (autoshard.cache): list them, or clear them",
        add_arguments=_cache_arguments,
        run=_cache_run,
    ),
    "profile": _Command(
        help="measure this machine's devices (matmuls, copies, collectives) and write a cost profile",
        add_arguments=_profile_arguments,
        run=_profile_run,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoshard",
        description="Automatic parallelization of JAX train steps: trace, plan, run.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in _COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
    return parser


class _Progress(logging.Handler):
    """The planner's progress (the ``autoshard`` logger at INFO) on whatever ``sys.stderr`` is when a
    message comes, with the seconds since the command started."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("[%(relativeCreated)7.0f ms] %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from autoshard.errors import AutoshardError

    logger = logging.getLogger("autoshard")
    progress, level = None, logger.level
    if not getattr(args, "quiet", True):
        progress = _Progress()
        logger.addHandler(progress)
        logger.setLevel(logging.INFO)
    try:
        return _COMMANDS[args.command].run(args)
    except AutoshardError as e:
        print(f"autoshard {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed early: not an error
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at interpreter exit
        return 0
    finally:
        if progress is not None:
            logger.removeHandler(progress)
            logger.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())

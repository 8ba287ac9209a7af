"""``PlanOptions``: the one object ``autoshard.plan``, ``@autoshard.parallelize`` and the CLI's ``plan`` and
``compare`` take their options as; the keywords are a spelling of it."""

import dataclasses
import inspect
import pydoc
import typing
from pathlib import Path

import pytest

import autoshard
from autoshard import PlanOptions, api
from autoshard._examples import load_example
from autoshard.cli import main
from autoshard.errors import AutoshardError
from autoshard.options import (
    FIELDS,
    PARALLELIZE_DEFAULTS,
    PLAN_DEFAULTS,
    Recompute,
    Runtime,
    Schedule,
    UnknownOption,
)
from autoshard.planner.recompute import RECOMPUTE_CHOICES
from autoshard.target import RUNTIMES, SCHEDULES, PipelineOptions, Target

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "examples" / "mlp.py")


@pytest.fixture(scope="module")
def mlp():
    return load_example(ROOT / "examples" / "mlp.py", "tiny", abstract=True)


class _Stop(AutoshardError):
    """Raised by a stand-in for the planner once it has seen what it was asked."""


def _request(monkeypatch: pytest.MonkeyPatch, call) -> dict:
    """What ``call()`` asks the planner for (``api.plan_for``'s arguments), without planning."""
    seen = {}

    def plan_for(step_fn, args, target, options, **kw):
        seen.update(target=target, options=options, **kw)
        raise _Stop

    monkeypatch.setattr(api, "plan_for", plan_for)
    with pytest.raises(_Stop):
        call()
    return seen


# ---- the keywords and the object are one request ---------------------------------------------------------------


def test_the_keywords_and_the_object_make_the_same_plan_request(mlp, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = dict(mesh="2x4", hardware="a100", memory_budget="40GiB", time_budget_s=7, microbatches=4, schedule="zb-h1",
              pipeline=True, num_layers=3, max_stages=2, recompute="selective", runtime="spmd", batch_argnums=1,
              roles={"state.params": "param"})
    by_keywords = _request(monkeypatch, lambda: autoshard.plan(mlp.train_step, *mlp.args, **kw))
    by_object = _request(monkeypatch, lambda: autoshard.plan(mlp.train_step, *mlp.args, options=PlanOptions(**kw)))
    # both: the keywords replace those fields of the object
    half = {k: v for k, v in kw.items() if k not in ("schedule", "runtime")}
    mixed = _request(monkeypatch, lambda: autoshard.plan(mlp.train_step, *mlp.args, options=PlanOptions(**half),
                                                        schedule="zb-h1", runtime="spmd"))
    assert by_keywords == by_object == mixed
    target, options = by_keywords["target"], by_keywords["options"]
    assert target == Target.of((2, 4), "a100", "40GiB") and target.memory_budget == 40 * 2**30
    assert options == PipelineOptions(microbatches=4, pipeline=True, schedule="zb-h1", num_layers=3, max_stages=2,
                                      uniform=True)  # runtime="spmd": only stages the SPMD program runs
    assert by_keywords["time_budget_s"] == 7 and by_keywords["recompute"] == "selective"
    assert by_keywords["roles"] == {1: "batch", "state.params": "param"}
    # plan's defaults: 8 devices on one axis, priced as H100s
    default = _request(monkeypatch, lambda: autoshard.plan(mlp.train_step, *mlp.args))
    assert default["target"] == Target.of((8,), "h100")
    assert default["options"] == PipelineOptions(spmd_if_faster=True)  # runtime "auto" on one host


def test_a_plan_by_keywords_equals_the_plan_by_options(mlp) -> None:
    graph = autoshard.trace(mlp.train_step, *mlp.args)
    by_keywords = autoshard.plan(graph, mesh=(2, 4), time_budget_s=5)
    by_object = autoshard.plan(graph, options=PlanOptions(mesh=(2, 4), time_budget_s=5))
    assert by_keywords.specs == by_object.specs
    assert by_keywords.predicted_step_time == by_object.predicted_step_time


def test_parallelize_reads_the_same_options(mlp) -> None:
    step = autoshard.parallelize(mlp.train_step, options=PlanOptions(mesh=(2, 4)), microbatches=4, schedule="1f1b")
    assert step.options == PlanOptions(mesh=(2, 4), microbatches=4, schedule="1f1b")
    assert autoshard.parallelize(mesh=(2, 4), microbatches=4, schedule="1f1b").options == step.options
    # its defaults: the devices present (8 simulated CPUs, on one axis), priced by their own profile
    target = autoshard.parallelize(mlp.train_step).target
    assert target.shape == (8,) and target.hardware == Target.of((8,), "auto").hardware
    assert step.target.shape == (2, 4) and step.target.axis_names == ("x", "y")
    # plan= is still its own argument: a given plan runs instead of planning
    given = autoshard.plan(autoshard.trace(mlp.train_step, *mlp.args), mesh=(2, 4), time_budget_s=3)
    assert autoshard.parallelize(mlp.train_step, mesh=(2, 4), plan=given).given_plan is given


# ---- errors name the option ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("wrong", "closest"), [("microbatch", "microbatches"), ("num_microbatches", "microbatches"),
                                                ("chunks", "num_chunks"), ("time_budget", "time_budget_s"),
                                                ("memory", "memory_budget"), ("schedul", "schedule")])
def test_an_unknown_keyword_names_the_closest_option(mlp, wrong: str, closest: str) -> None:
    for call in (lambda: autoshard.plan(mlp.train_step, *mlp.args, **{wrong: 4}),
                 lambda: autoshard.parallelize(mlp.train_step, **{wrong: 4}),
                 lambda: PlanOptions.of(None, **{wrong: 4})):
        with pytest.raises(UnknownOption, match=f"unknown planning option '{wrong}': did you mean '{closest}'"):
            call()
    # a TypeError too, as Python's own for an unexpected keyword
    with pytest.raises(TypeError, match=r"the options are autoshard\.PlanOptions' fields: mesh, hardware"):
        autoshard.plan(mlp.train_step, *mlp.args, xyzzy=1)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("mesh", "2x", r"mesh '2x': expected sizes joined by 'x'"),
    ("mesh", (2, 0), r"every axis needs a size >= 1"),
    ("hardware", 3, r"hardware=3: expected a preset name"),
    ("memory_budget", "80 furlongs", r"memory budget '80 furlongs'.*optional unit"),
    ("memory_budget", -1, r"memory budget -1: must be a positive"),
    ("time_budget_s", 0, r"time budget 0: give a positive, finite number of seconds"),
    ("roles", ["batch"], r"roles=\['batch'\]: expected a mapping"),
    ("batch_argnums", -1, r"batch_argnums holds -1; expected argument positions"),
    ("batch_argnums", 1.5, r"batch_argnums=1.5: expected an argument position"),
    ("recompute", "sometimes", r"recompute='sometimes': expected one of auto, none, selective, full"),
    ("runtime", "threads", r"runtime='threads' is not one of auto, spmd, mpmd"),
    ("microbatches", 0, r"microbatches=0: give a whole number >= 1"),
    ("pipeline", "yes", r"pipeline='yes': give True"),
    ("pipeline", True, r"pipeline=True needs microbatches=B"),
    ("schedule", "zb", r"schedule 'zb': the pipeline runtime runs 1f1b, gpipe"),
    ("num_chunks", 0, r"num_chunks=0: give a whole number"),
    ("num_layers", 2.5, r"num_layers=2.5: give a whole number"),
    ("max_stages", -2, r"max_stages=-2: give a whole number"),
    ("stage_shape", (1, 2, 3), r"stage_shape=\(1, 2, 3\): give \(hosts, devices\)"),
    ("stage_shape", "1x4", r"stage_shape='1x4': give \(hosts, devices\)"),
    ("unroll_scans", "no", r"unroll_scans='no': give True"),
])
def test_a_bad_value_names_the_option_when_it_is_given(mlp, field: str, value, message: str) -> None:
    # refused when the options are made: parallelize too, before any call
    for call in (lambda: PlanOptions(**{field: value}),
                 lambda: autoshard.plan(mlp.train_step, *mlp.args, **{field: value}),
                 lambda: autoshard.parallelize(mlp.train_step, **{field: value})):
        with pytest.raises(AutoshardError, match=message):
            call()


def test_options_must_be_plan_options() -> None:
    with pytest.raises(AutoshardError, match=r"options=\{'mesh': 8\} \(dict\): expected an autoshard.PlanOptions"):
        autoshard.parallelize(options={"mesh": 8})


# ---- frozen data ---------------------------------------------------------------------------------------------------


def test_options_are_frozen_and_compare_and_hash_by_value() -> None:
    a = PlanOptions(mesh="2x4", microbatches=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.microbatches = 8  # type: ignore[misc]
    # one mesh, three spellings: kept as a tuple of sizes
    assert a == PlanOptions(mesh=(2, 4), microbatches=4) == PlanOptions(mesh=[2, 4], microbatches=4)
    assert a.mesh == (2, 4) and len({a, PlanOptions(mesh=[2, 4], microbatches=4)}) == 1
    assert a != PlanOptions(mesh=(4, 2), microbatches=4) and a != dataclasses.replace(a, microbatches=8)
    # mappings are copied (the caller's dict changing later changes nothing) and ordered (a mesh's axes are)
    roles = {"state.params": "param"}
    b = PlanOptions(mesh={"data": 2, "model": 4}, roles=roles, batch_argnums=[1], stage_shape=[1, 4])
    roles["batch"] = "batch"
    assert b.roles == {"state.params": "param"} and b.batch_argnums == (1,) and b.stage_shape == (1, 4)
    assert hash(b) == hash(PlanOptions(mesh={"data": 2, "model": 4}, roles={"state.params": "param"},
                                       batch_argnums=(1,), stage_shape=(1, 4)))
    assert b != PlanOptions(mesh={"model": 4, "data": 2}, roles={"state.params": "param"}, batch_argnums=(1,),
                            stage_shape=(1, 4))
    # a CostModel as the hardware: hashable still, compared by its own ==
    cost = Target.of((2, 4), "h100").cost
    assert PlanOptions(hardware=cost) == PlanOptions(hardware=cost) and hash(PlanOptions(hardware=cost))


def test_what_the_passes_take_is_derived_from_the_options() -> None:
    opts = PlanOptions(mesh=(8, 8), microbatches=16, roles={"state.params": "param"}, batch_argnums=1)
    target = opts.target()
    assert target == Target.of((8, 8), PLAN_DEFAULTS["hardware"]) and target.spans_hosts
    # runtime "auto" on a mesh across hosts: stages the SPMD program runs (``target.runtime_options``)
    assert opts.pipeline_options(target) == PipelineOptions(microbatches=16, uniform=True)
    one_host = Target.of((2, 4), "h100")
    assert opts.pipeline_options(one_host) == PipelineOptions(microbatches=16, spmd_if_faster=True)
    assert opts.pipeline_options(one_host, processes=2).uniform
    assert opts.input_roles() == {1: "batch", "state.params": "param"}
    with pytest.raises(AutoshardError, match="no mesh to plan for"):
        PlanOptions().target(PARALLELIZE_DEFAULTS)


# ---- the CLI spells the same object ------------------------------------------------------------------------------


def test_the_cli_flags_map_onto_the_options_of_the_python_call(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def plan(step_fn, *args, options=None, **kwargs):
        seen.append(PlanOptions.of(options, **kwargs))
        raise _Stop

    monkeypatch.setattr(api, "plan", plan)
    flags = ["--mesh", "2x4", "--microbatches", "4", "--schedule", "zb-h1", "--pipeline", "yes", "--chunks", "3",
             "--layers", "5", "--max-stages", "2", "--stage-shape", "1x2", "--recompute", "full", "--runtime",
             "spmd", "--time-budget", "9", "--memory-budget", "60GiB", "--hardware", "a100", "-q"]
    assert main(["plan", MLP, *flags]) == 2
    assert main(["plan", MLP, "--microbatches", "4", "--schedule", "zb-h1", "-q"]) == 2
    assert main(["plan", MLP, "--mesh", "8", "--axes", "model", "-q"]) == 2
    assert main(["plan", MLP, "--keep-scans", "-q"]) == 2
    assert seen == [
        PlanOptions(mesh="2x4", microbatches=4, schedule="zb-h1", pipeline=True, num_chunks=3, num_layers=5,
                    max_stages=2, stage_shape=(1, 2), recompute="full", runtime="spmd", time_budget_s=9,
                    memory_budget="60GiB", hardware="a100"),
        PlanOptions(microbatches=4, schedule="zb-h1"),  # the defaults are plan's own
        PlanOptions(mesh={"model": 8}),
        PlanOptions(unroll_scans=False),
    ]


def test_compare_reads_its_target_and_recompute_from_the_same_options(monkeypatch: pytest.MonkeyPatch) -> None:
    import autoshard.planner.compare as compare_module

    seen = {}

    def compare(graph, cost, **kw):
        seen.update(cost=cost, **kw)
        raise _Stop

    monkeypatch.setattr(compare_module, "compare", compare)
    assert main(["compare", MLP, "--mesh", "2x4", "--hardware", "a100", "--memory-budget", "30GiB", "--recompute",
                 "none", "--time-budget", "4", "-q"]) == 2
    target = PlanOptions(mesh=(2, 4), hardware="a100", memory_budget="30GiB").target()
    assert seen["cost"] == target.cost and seen["hardware"] == target.hardware == "a100"
    assert seen["memory_budget"] == target.memory_budget and seen["recompute"] == "none"
    assert seen["total_budget_s"] == 4


# ---- the signature shows the fields ------------------------------------------------------------------------------


def test_the_signatures_list_every_option_with_the_entry_points_defaults() -> None:
    for entry, defaults in ((autoshard.plan, PLAN_DEFAULTS), (autoshard.parallelize, PARALLELIZE_DEFAULTS)):
        params = inspect.signature(entry).parameters
        assert "options" in params and not any(p.kind is p.VAR_KEYWORD for p in params.values())
        for f in dataclasses.fields(PlanOptions):
            p = params[f.name]
            assert p.kind is p.KEYWORD_ONLY and p.annotation == f.type
            assert p.default == defaults.get(f.name, f.default)
        text = pydoc.render_doc(entry)
        assert "microbatches" in text and "stage_shape" in text
    plan_params = inspect.signature(autoshard.plan).parameters
    assert plan_params["mesh"].default == (8,) and plan_params["hardware"].default == "h100"
    assert inspect.signature(autoshard.parallelize).parameters["hardware"].default == "auto"
    assert "plan" in inspect.signature(autoshard.parallelize).parameters


def test_every_option_is_documented_and_its_choices_are_the_ones_checked() -> None:
    assert FIELDS == ("mesh", "hardware", "memory_budget", "time_budget_s", "roles", "batch_argnums", "recompute",
                      "unroll_scans", "runtime", "microbatches", "pipeline", "schedule", "num_chunks", "num_layers",
                      "max_stages", "stage_shape")
    for name in FIELDS:
        assert len(PlanOptions.doc(name)) > 40 and f"``{name}``:" in PlanOptions.__doc__
    assert set(typing.get_args(Schedule)) == {"auto", *SCHEDULES}
    assert typing.get_args(Recompute) == RECOMPUTE_CHOICES
    assert typing.get_args(Runtime) == RUNTIMES

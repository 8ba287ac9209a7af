"""Pipeline schedules: validity, known peaks, makespans and bubbles, rejection of broken tables, round trips."""

import ast
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.pipeline.schedules import (
    SCHEDULE_NAMES,
    Action,
    Schedule,
    chunk_inflight_rule,
    gpipe,
    inflight_rule,
    interleaved_1f1b,
    one_f_one_b,
    schedule,
)

ROOT = Path(__file__).resolve().parents[1]

GRID = [(S, B) for S in (1, 2, 3, 4, 5) for B in (1, 2, 3, 4, 7, 8)]
INTERLEAVED_GRID = [(S, k * S, v) for S in (1, 2, 3, 4) for k in (1, 2, 3) for v in (2, 3)]


def _built() -> list[Schedule]:
    out = [gpipe(S, B) for S, B in GRID] + [one_f_one_b(S, B) for S, B in GRID]
    return out + [interleaved_1f1b(S, B, v) for S, B, v in INTERLEAVED_GRID]


def _slot_of(sched: Schedule) -> dict[tuple[int, int, str], int]:
    S = sched.num_stages
    return {
        (a.chunk * S + a.stage, a.microbatch, a.kind): t for t, slot in enumerate(sched.slots) for a in slot
    }


def _bubble(S: int, B: int, v: int = 1) -> float:
    return (S - 1) / (v * B + S - 1)


# ---------------------------------------------------------------------- layering


def test_the_pipeline_program_imports_the_standard_library_and_numpy_only() -> None:
    # The schedules live in ``solvers.pipeline`` with their lowering and price: every module there imports the
    # standard library, numpy and its own package only (``solvers``' own ``__init__`` loads the ILP's solver
    # libraries, so the imports are read from the source, not from a fresh interpreter's ``sys.modules``).
    found = set()
    for path in sorted((ROOT / "solvers" / "pipeline").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
    assert found, "no imports read"
    bad = sorted(m for m in found if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "numpy"
                 and not m.startswith("solvers.pipeline"))
    assert not bad, f"solvers.pipeline must import the standard library and numpy only, not {bad}"


# ---------------------------------------------------------------------- validity


@pytest.mark.parametrize(
    "sched", _built(), ids=lambda s: f"{s.name}-S{s.num_stages}-B{s.num_microbatches}-v{s.num_chunks}"
)
def test_built_schedules_verify_and_respect_dependencies(sched: Schedule) -> None:
    sched.verify()
    S, B, v = sched.num_stages, sched.num_microbatches, sched.num_chunks
    slot = _slot_of(sched)
    # every microbatch passes every virtual stage once each way
    assert sum(len(s) for s in sched.slots) == 2 * S * v * B == len(slot)
    for m in range(B):
        for u in range(S * v):
            assert slot[(u, m, "forward")] < slot[(u, m, "backward")]
            if u + 1 < S * v:
                assert slot[(u, m, "forward")] < slot[(u + 1, m, "forward")]
                assert slot[(u + 1, m, "backward")] < slot[(u, m, "backward")]
    for t, actions in enumerate(sched.slots):
        stages = [a.stage for a in actions]
        assert len(stages) == len(set(stages)), f"slot {t}"
    for s in range(S):
        assert len(sched.actions(s)) == 2 * v * B


@pytest.mark.parametrize(("S", "B"), GRID)
def test_peak_inflight_gpipe_and_1f1b(S: int, B: int) -> None:
    assert [gpipe(S, B).peak_inflight(s) for s in range(S)] == [B] * S
    assert [one_f_one_b(S, B).peak_inflight(s) for s in range(S)] == [min(S - s, B) for s in range(S)]


@pytest.mark.parametrize(("S", "B", "v"), INTERLEAVED_GRID)
def test_peak_inflight_interleaved_is_megatron_warmup_plus_one(S: int, B: int, v: int) -> None:
    sched = interleaved_1f1b(S, B, v)
    for s in range(S):
        warmup = min(2 * (S - 1 - s) + (v - 1) * S, v * B)
        assert sched.peak_inflight(s) == min(warmup + 1, v * B)


def test_inflight_rule_counts_from_the_end() -> None:
    assert inflight_rule("1f1b", 4, 3) == (1, 2, 3, 3)
    assert inflight_rule("1f1b", 4, 8) == (1, 2, 3, 4)
    assert inflight_rule("gpipe", 3, 5) == (5, 5, 5)
    assert inflight_rule("interleaved-1f1b", 4, 8, 2) == (5, 7, 9, 11)
    for S, B in GRID:
        assert inflight_rule("1f1b", S, B) == tuple(min(r + 1, B) for r in range(S))


def test_chunk_inflight_counts_each_chunks_own_microbatches() -> None:
    # interleaved 1F1B: the last stage runs its first chunk's S forwards before any backward, then its
    # second chunk one microbatch at a time; a chunk's plan counts its own, the stage all of them
    for S, B in ((4, 8), (8, 16), (16, 64)):
        per_chunk = chunk_inflight_rule("interleaved-1f1b", S, B, 2)
        total = inflight_rule("interleaved-1f1b", S, B, 2)
        assert [len(c) for c in per_chunk] == [2] * S
        assert all(sum(c) >= t for c, t in zip(per_chunk, total, strict=True))
        assert per_chunk[0][1] <= 2 < per_chunk[0][0]
    assert chunk_inflight_rule("1f1b", 4, 8) == tuple((n,) for n in inflight_rule("1f1b", 4, 8))


# ---------------------------------------------------------------------- timing


@pytest.mark.parametrize(("S", "B"), GRID)
def test_unit_time_makespan_and_bubble(S: int, B: int) -> None:
    for sched in (gpipe(S, B), one_f_one_b(S, B)):
        assert len(sched.slots) == 2 * (B + S - 1)
        assert sched.simulate([1.0] * S, [1.0] * S).makespan == 2 * (B + S - 1)
        for fwd, bwd in ((1.0, 1.0), (1.0, 2.0)):
            assert sched.bubble_fraction(fwd, bwd) == pytest.approx(_bubble(S, B))


@pytest.mark.parametrize(("S", "B", "v"), INTERLEAVED_GRID)
def test_interleaved_bubble_matches_the_paper(S: int, B: int, v: int) -> None:
    # Narayanan et al. 2021 §2.2: bubble / ideal = (S-1) / (v·B), i.e. (S-1) / (v·B + S-1) of the step.
    sched = interleaved_1f1b(S, B, v)
    for fwd, bwd in ((1.0, 1.0), (1.0, 2.0)):
        assert sched.bubble_fraction(fwd, bwd) == pytest.approx(_bubble(S, B, v))
        if S > 1:
            assert sched.bubble_fraction(fwd, bwd) < one_f_one_b(S, B).bubble_fraction(fwd, bwd)


def test_simulate_uneven_stages_and_comm() -> None:
    # Two stages, one microbatch: F0 -> comm -> F1 -> B1 -> comm -> B0.
    sched = one_f_one_b(2, 1)
    res = sched.simulate([1.0, 3.0], [2.0, 5.0], comm_time=0.5)
    assert res.makespan == pytest.approx(1 + 0.5 + 3 + 5 + 0.5 + 2)
    assert res.start[Action(1, 0, "backward")] == pytest.approx(4.5)
    assert res.busy == (3.0, 8.0)
    with pytest.raises(ValueError, match="one per virtual stage"):
        sched.simulate([1.0], [1.0])
    broken = replace(sched, slots=tuple(reversed(sched.slots)))
    with pytest.raises(ValueError, match="is not a valid schedule"):
        broken.simulate([1.0, 1.0], [1.0, 1.0])


def test_simulate_charges_no_comm_between_chunks_of_one_stage() -> None:
    sched = interleaved_1f1b(1, 1, 2)  # one stage, two chunks: all hops stay on the device
    assert sched.simulate([1.0, 1.0], [1.0, 1.0], comm_time=10.0).makespan == 4.0


# ---------------------------------------------------------------------- rejection


def _hand(slots: list[list[Action]], S: int = 2, B: int = 1, v: int = 1) -> Schedule:
    return Schedule(
        name="hand", num_stages=S, num_microbatches=B, num_chunks=v, slots=tuple(tuple(s) for s in slots)
    )


def test_verify_accepts_a_hand_made_schedule() -> None:
    F, Bw = "forward", "backward"
    _hand([[Action(0, 0, F)], [Action(1, 0, F)], [Action(1, 0, Bw)], [Action(0, 0, Bw)]]).verify()


def test_verify_rejects_backward_before_forward() -> None:
    F, Bw = "forward", "backward"
    bad = _hand([[Action(0, 0, F)], [Action(1, 0, Bw)], [Action(1, 0, F)], [Action(0, 0, Bw)]])
    with pytest.raises(
        ValueError,
        match=r"backward of microbatch 0 at virtual stage 1 in slot 1 must come "
        r"after forward of microbatch 0 at virtual stage 1",
    ):
        bad.verify()


def test_verify_rejects_same_slot_dependency() -> None:
    F, Bw = "forward", "backward"
    bad = _hand([[Action(0, 0, F), Action(1, 0, F)], [Action(1, 0, Bw)], [Action(0, 0, Bw)]])
    with pytest.raises(ValueError, match="must come after forward of microbatch 0 at virtual stage 0"):
        bad.verify()


def test_verify_rejects_missing_microbatch() -> None:
    sched = one_f_one_b(2, 2)
    dropped = tuple(tuple(a for a in slot if a.microbatch != 1) for slot in sched.slots)
    with pytest.raises(ValueError, match="missing forward of microbatch 1 at virtual stage 0"):
        replace(sched, slots=dropped).verify()


def test_verify_rejects_two_actions_on_one_stage_in_a_slot() -> None:
    F, Bw = "forward", "backward"
    good = _hand(
        [
            [Action(0, 0, F)],
            [Action(0, 1, F), Action(1, 0, F)],
            [Action(1, 0, Bw)],
            [Action(0, 0, Bw), Action(1, 1, F)],
            [Action(1, 1, Bw)],
            [Action(0, 1, Bw)],
        ],
        B=2,
    )
    good.verify()
    clash = list(map(list, good.slots))
    clash[0].append(Action(0, 1, F))
    clash[1] = [Action(1, 0, F)]
    with pytest.raises(
        ValueError,
        match="stage 0 runs two actions at once, forward of microbatch 0 at "
        "virtual stage 0 and forward of microbatch 1",
    ):
        _hand(clash, B=2).verify()


def test_verify_rejects_duplicates_and_out_of_range() -> None:
    sched = gpipe(2, 1)
    doubled = (*sched.slots, (Action(0, 0, "backward"),))
    with pytest.raises(ValueError, match="appears twice"):
        replace(sched, slots=doubled).verify()
    with pytest.raises(ValueError, match=r"microbatch=5 not in \[0, 1\)"):
        replace(sched, slots=(*sched.slots, (Action(0, 5, "forward"),))).verify()
    with pytest.raises(ValueError, match="has kind 'sideways'"):
        replace(sched, slots=(*sched.slots, (Action(0, 0, "sideways"),))).verify()  # type: ignore[arg-type]


# ---------------------------------------------------------------------- builders, data, rendering


def test_dispatch_and_errors() -> None:
    assert schedule("gpipe", 3, 4) == gpipe(3, 4)
    assert schedule("1f1b", 3, 4) == one_f_one_b(3, 4)
    assert schedule("interleaved-1f1b", 2, 4, chunks=2) == interleaved_1f1b(2, 4, 2)
    assert set(SCHEDULE_NAMES) == {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1"}
    with pytest.raises(ValueError, match="expected one of gpipe, 1f1b, interleaved-1f1b"):
        schedule("zero-bubble", 2, 2)
    with pytest.raises(ValueError, match="must be a multiple of num_stages"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match="at least 2"):
        interleaved_1f1b(2, 4, 1)
    with pytest.raises(ValueError, match="use 'interleaved-1f1b'"):
        schedule("1f1b", 2, 2, chunks=2)
    with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
        one_f_one_b(2, 0)


def test_round_trip_through_json() -> None:
    for sched in (gpipe(3, 2), one_f_one_b(4, 6), interleaved_1f1b(2, 4, 3)):
        back = Schedule.from_dict(json.loads(json.dumps(sched.to_dict())))
        assert back == sched
        back.verify()


def test_ascii_timeline() -> None:
    assert str(one_f_one_b(2, 2)) == (
        "1f1b: 2 stages, 2 microbatches, 6 slots\nstage 0: F0 F1 .  B0 .  B1\nstage 1: .  F0 B0 F1 B1 ."
    )
    assert "stage 1: .    F0.0 F1.0" in str(interleaved_1f1b(2, 2, 2))


def test_actions_in_execution_order() -> None:
    kinds = [(a.kind[0], a.microbatch) for a in one_f_one_b(3, 4).actions(0)]
    assert kinds == [("f", 0), ("f", 1), ("f", 2), ("b", 0), ("f", 3), ("b", 1), ("b", 2), ("b", 3)]


# ---------------------------------------------------------------------- properties


@st.composite
def _schedules(draw: st.DrawFn) -> Schedule:
    name = draw(st.sampled_from(SCHEDULE_NAMES))
    S = draw(st.integers(1, 5))
    if name == "interleaved-1f1b":
        return interleaved_1f1b(S, S * draw(st.integers(1, 3)), draw(st.integers(2, 3)))
    return schedule(name, S, draw(st.integers(1, 8)))


@settings(max_examples=40, deadline=None)
@given(_schedules(), st.data())
def test_simulation_respects_order_and_dependencies(sched: Schedule, data: st.DataObject) -> None:
    V = sched.num_virtual_stages
    times = st.lists(st.floats(0.1, 5.0), min_size=V, max_size=V)
    fwd, bwd = data.draw(times), data.draw(times)
    comm = data.draw(st.floats(0.0, 2.0))
    wgt = data.draw(times) if sched.weight_pass else None
    res = sched.simulate(fwd, bwd, comm, weight_times=wgt)
    S = sched.num_stages
    for s in range(S):
        order = sched.actions(s)
        for a, b in itertools.pairwise(order):
            assert res.end[a] <= res.start[b] + 1e-9
        assert res.busy[s] == pytest.approx(sum(res.end[a] - res.start[a] for a in order))
    by_key = {(a.virtual_stage(S), a.microbatch, a.kind): a for a in res.start}
    for (u, m, kind), a in by_key.items():
        deps = [(u - 1, m, "forward")] if kind == "forward" and u else []
        if kind == "backward":
            deps = [(u, m, "forward")] + ([(u + 1, m, "backward")] if u + 1 < V else [])
        if kind == "weight":
            deps = [(u, m, "backward")]
        for d in deps:
            gap = comm if by_key[d].stage != a.stage else 0.0
            assert res.end[by_key[d]] + gap <= res.start[a] + 1e-9
    # the step is never shorter than one stage's work, nor than one microbatch's round trip
    assert res.makespan >= max(res.busy) - 1e-9
    assert res.makespan >= sum(fwd) + sum(bwd) - 1e-9


@settings(max_examples=40, deadline=None)
@given(_schedules(), st.data())
def test_dropping_or_moving_any_action_breaks_verify(sched: Schedule, data: st.DataObject) -> None:
    flat = [(t, i) for t, slot in enumerate(sched.slots) for i in range(len(slot))]
    t, i = data.draw(st.sampled_from(flat))
    victim = sched.slots[t][i]
    without = [list(slot) for slot in sched.slots]
    del without[t][i]
    with pytest.raises(ValueError, match="missing"):
        replace(sched, slots=tuple(map(tuple, without))).verify()
    # moved to the very front, an action with a dependency runs before it; one with none is fine
    moved = [[victim], *without]
    has_dep = victim.kind in ("backward", "weight") or victim.virtual_stage(sched.num_stages) > 0
    if has_dep:
        with pytest.raises(ValueError, match="must come after"):
            replace(sched, slots=tuple(map(tuple, moved))).verify()
    else:
        replace(sched, slots=tuple(map(tuple, moved))).verify()


@pytest.mark.parametrize("name,S,B,v", [("1f1b", 4, 8, 1), ("1f1b", 3, 2, 1), ("zb-h1", 4, 8, 1), ("zb-h1", 2, 1, 1),
                                        ("gpipe", 3, 5, 1), ("gpipe", 2, 1, 1), ("interleaved-1f1b", 2, 4, 2)])
def test_a_tail_gap_leaves_a_slot_between_the_last_forward_and_backward_at_the_same_length(
        name: str, S: int, B: int, v: int) -> None:
    # a tail spread over other stages runs in the slot after the last virtual stage's forward. 1F1B and
    # the interleaved schedule fill it with one more warm-up forward per stage: no longer (for B > 1), one
    # more microbatch in flight. ZB-H1's last stage fills it with a weight pass: one slot longer, and only
    # the last stage holds one more
    plain, gapped = schedule(name, S, B, v), schedule(name, S, B, v, tail_gap=1)
    gapped.verify()
    slot = _slot_of(gapped)
    V = S * v
    assert all(slot[(V - 1, m, "backward")] >= slot[(V - 1, m, "forward")] + 2 for m in range(B))
    if B > 1:
        assert len(gapped.slots) == len(plain.slots) + (name == "zb-h1")
    if name == "1f1b":
        assert gapped.peak_inflight_all() == tuple(min(S - s + 1, B) for s in range(S))
    if name == "zb-h1":
        assert gapped.peak_inflight_all() == (*plain.peak_inflight_all()[:-1], min(2, B))
    # the gap is part of the schedule: verify refuses a backward right after its forward, and JSON keeps it
    assert Schedule.from_dict(json.loads(json.dumps(gapped.to_dict()))) == gapped
    tight = _slot_of(plain)
    if any(tight[(V - 1, m, "backward")] == tight[(V - 1, m, "forward")] + 1 for m in range(B)):
        with pytest.raises(ValueError, match=r"1 slot\(s\) for the tail"):
            replace(plain, tail_gap=1).verify()

"""The pipeline program (``solvers.pipeline``): every generator's program is valid, and ``simulate`` is one price
that agrees with itself (lockstep never beats async), with the in-flight rules and with Alpa's closed form
where both apply. Pure: no JAX, milliseconds a case."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solvers.inter_op import pipeline_cost
from solvers.pipeline import (
    Costs,
    PipelineProgram,
    action_tables,
    exchanges,
    fused_1f1b,
    schedule,
    simulate,
    ticks,
    zb_h1,
    zb_v,
)
from solvers.pipeline.program import _deps

FAST = settings(max_examples=60, deadline=None)


@st.composite
def programs(draw: st.DrawFn) -> PipelineProgram:
    """Any program a generator makes: a schedule by name (interleaved needs B a multiple of S), or fused
    1F1B, with or without a tail gap, or ZB-V."""
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "fused-1f1b", "zb-v"]))
    S = draw(st.integers(1, 5))
    gap = draw(st.integers(0, 1))
    if name == "zb-v":
        return zb_v(S, draw(st.integers(1, 9)), gap)
    if name == "interleaved-1f1b":
        return schedule(name, S, S * draw(st.integers(1, 3)), draw(st.integers(2, 3)), gap)
    B = draw(st.integers(1, 9))
    return fused_1f1b(S, B, gap) if name == "fused-1f1b" else schedule(name, S, B, 1, gap)


def _costs(program: PipelineProgram, draw: st.DrawFn, **rest: float) -> Costs:
    V = program.num_virtual_stages
    times = st.lists(st.floats(0.1, 4.0), min_size=V, max_size=V)
    return Costs(forward=draw(times), backward=draw(times), weight=draw(times) if program.weight_pass else (),
                 **rest)


@given(programs())
@FAST
def test_every_program_runs_each_pass_once_after_what_it_needs(program: PipelineProgram) -> None:
    program.verify()
    S, V = program.num_stages, program.num_virtual_stages
    seen = Counter((a.virtual_stage(S, program.v_shape), a.microbatch, a.kind) for slot in program.slots for a in slot)
    kinds = program.kinds
    assert set(seen.values()) == {1}
    assert set(seen) == {(u, m, k) for u in range(V) for m in range(program.num_microbatches) for k in kinds}
    # a dependency runs in an earlier slot, or (fused) as the stage's own forward earlier in the same slot
    at = {(a.virtual_stage(S, program.v_shape), a.microbatch, a.kind): (t, i)
          for t, slot in enumerate(program.slots) for i, a in enumerate(slot)}
    for key, (t, i) in at.items():
        for dep in _deps(key, V):
            gap = program.tail_gap if (key[0] == V - 1 and key[2] == "backward" and dep[2] == "forward") else 0
            dt, di = at[dep]
            assert dt + gap < t or (program.fused and not gap and dt == t and di < i), (key, dep)
    # every stage runs one action a slot, or a forward then a backward where fused
    for slot in program.slots:
        per_stage = Counter(a.stage for a in slot)
        assert max(per_stage.values(), default=0) <= (2 if program.fused else 1)


@given(st.data())
@FAST
def test_lockstep_never_beats_async_on_the_same_program(data: st.DataObject) -> None:
    program = data.draw(programs())
    x = data.draw(st.sampled_from([0.0, 0.05, 0.5]))
    costs = _costs(program, data.draw, comm=x, exchange=x)
    lazy = simulate(program, costs, "async")
    lock = simulate(program, costs, "lockstep")
    assert lock.loop >= lazy.loop * (1 - 1e-12)
    # both modes see the same work and the same order, so the same busy time and memory
    assert np.allclose(lock.busy, lazy.busy)
    assert lock.inflight == lazy.inflight and lock.inflight_by_chunk == lazy.inflight_by_chunk
    assert lock.ticks == lazy.ticks == len(program.slots)


def _walked_inflight(program: PipelineProgram) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The in-flight rule as ``Schedule.peak_inflight_all`` walked it before ``simulate`` counted it on
    arrays: the set of (chunk, microbatch) a stage holds, from its forward to its last pass."""
    S, last = program.num_stages, "weight" if program.weight_pass else "backward"
    live: list[set[tuple[int, int]]] = [set() for _ in range(S)]
    peak = [0] * S
    by_chunk = [[0] * program.num_chunks for _ in range(S)]
    for slot in program.slots:
        for a in slot:
            if a.kind == "forward":
                live[a.stage].add((a.chunk, a.microbatch))
                peak[a.stage] = max(peak[a.stage], len(live[a.stage]))
                held = sum(c == a.chunk for c, _ in live[a.stage])
                by_chunk[a.stage][a.chunk] = max(by_chunk[a.stage][a.chunk], held)
            elif a.kind == last:
                live[a.stage].discard((a.chunk, a.microbatch))
    return tuple(peak), tuple(tuple(row) for row in by_chunk)


@given(programs())
@FAST
def test_memory_is_the_old_in_flight_rule(program: PipelineProgram) -> None:
    S, B, g = program.num_stages, program.num_microbatches, program.tail_gap
    V = program.num_virtual_stages
    got = simulate(program, Costs(forward=[1.0] * V, backward=[1.0] * V, weight=[1.0] * V), "async")
    assert (got.inflight, got.inflight_by_chunk) == _walked_inflight(program)
    assert got.inflight == program.peak_inflight_all()
    r = [S - 1 - s for s in range(S)]
    if program.fused:  # ``fused_inflight``'s rule: 2r + 1 (two more with a tail gap)
        assert got.inflight == tuple(min(2 * x + 1 + 2 * g, B) for x in r)
    elif program.name == "gpipe":
        assert got.inflight == (B,) * S
    elif program.name in ("1f1b", "zb-h1") and not g:
        assert got.inflight == tuple(min(x + 1, B) for x in r)
    elif program.name == "zb-v":  # half a stage a chunk: at most 1F1B's first stage, min(S, B) whole microbatches
        assert max(got.inflight) == 2 * min(S, B)


@given(st.integers(1, 6), st.integers(1, 12), st.lists(st.floats(0.1, 5.0), min_size=6, max_size=6),
       st.sampled_from(["gpipe", "1f1b"]))
@FAST
def test_alpas_closed_form_is_the_async_price_of_equal_stages_and_bounds_it_otherwise(
        S: int, B: int, pool: list[float], name: str) -> None:
    # the stage DP's objective (solvers.inter_op.pipeline_cost) against the one price, where both apply
    times = pool[:S]
    got = simulate(schedule(name, S, B), Costs.of_micro(times, weight_pass=False), "async")
    assert got.loop <= pipeline_cost(times, B) * (1 + 1e-12)
    equal = [times[0]] * S
    same = simulate(schedule(name, S, B), Costs.of_micro(equal, weight_pass=False), "async")
    assert same.loop == pytest.approx(pipeline_cost(equal, B), rel=1e-12)


def test_the_host_is_a_serial_resource_beside_the_stages() -> None:
    program = schedule("1f1b", 3, 6)
    costs = Costs.of_micro([1.0, 2.0, 1.5], weight_pass=False, update=(0.5, 0.25, 0.0), dispatch=0.01)
    free = simulate(program, costs, "async")
    assert free.passes == free.loop and free.step == pytest.approx(free.loop + 0.5 + 0.01)
    slow = simulate(program, Costs.of_micro([1.0, 2.0, 1.5], weight_pass=False, host=10 * free.loop), "async")
    assert slow.loop == free.loop and slow.passes == 10 * free.loop


def test_fused_1f1b_is_a_program_whose_ticks_are_the_formula() -> None:
    for S, M, g in ((1, 3, 0), (3, 5, 0), (4, 8, 1), (2, 1, 1)):
        d = 2 * g
        program = fused_1f1b(S, M, g)
        program.verify()
        t = action_tables(program, 2 if g else 1)
        assert t.fused and t.num_ticks == M + 2 * S - 2 + d
        want_f, want_b = np.full_like(t.f_micro, -1), np.full_like(t.b_micro, -1)
        for s in range(S):
            for m in range(M):
                want_f[m + s, s] = m
                want_b[m + 2 * (S - 1) - s + d, s] = m
        assert (t.f_micro == want_f).all() and (t.b_micro == want_b).all()
        if g:
            assert [int(x) for x in np.flatnonzero(t.tail_micro >= 0)] == [m + S for m in range(M)]
        # the buffers the SPMD program indexes: the residual slots hold what is in flight
        full = ticks(program, 2 if g else 1)
        assert full.res_slots == max(program.peak_inflight_all())


def test_lockstep_price_is_each_ticks_slowest_stage_plus_its_exchanges() -> None:
    # by hand, on the tables, as the SPMD program runs them (tests/test_spmd_program.py does the same
    # through ``ticks.price``)
    program = schedule("zb-h1", 3, 5)
    f, b, w = [1.0, 2.0, 3.0], [0.5, 1.5, 1.0], [0.25, 0.5, 2.0]
    got = simulate(program, Costs(forward=f, backward=b, weight=w, exchange=0.125), "lockstep")
    dur = {"forward": f, "backward": b, "weight": w}
    work = sum(max(dur[a.kind][a.stage] for a in slot) for slot in program.slots)
    assert got.loop == pytest.approx(work + len(program.slots) * 2 * 0.125)
    assert got.exchange == pytest.approx(len(program.slots) * 2 * 0.125)
    assert math.isclose(sum(got.busy), program.num_microbatches * (sum(f) + sum(b) + sum(w)))


def test_async_refuses_ticks_and_a_spread_tail_and_names_the_lengths_it_wants() -> None:
    program = schedule("1f1b", 2, 4, tail_gap=1)
    costs = Costs.of_micro([1.0, 1.0], weight_pass=False)
    with pytest.raises(TypeError, match="PipelineProgram"):
        simulate(action_tables(program), costs, "async")
    with pytest.raises(ValueError, match="lockstep"):
        simulate(program, costs, "async", tail_split=2)
    with pytest.raises(ValueError, match=r"costs\.forward has 1 entries, expected one per virtual stage"):
        simulate(program, Costs.of_micro([1.0], weight_pass=False), "async")
    with pytest.raises(ValueError, match=r"weight pass needs costs\.weight"):
        simulate(schedule("zb-h1", 2, 4), costs, "lockstep")
    with pytest.raises(ValueError, match="mode 'fast'"):
        simulate(program, costs, "fast")  # type: ignore[arg-type]


def test_zb_v_runs_its_chunks_in_a_v_and_fills_the_bubble_at_1f1bs_memory() -> None:
    for S, M in ((2, 2), (3, 5), (4, 8), (8, 16)):
        program = zb_v(S, M)
        assert program.place(0) == (0, 0) and program.place(2 * S - 1) == (0, 1)  # both ends on stage 0
        assert program.place(S - 1) == (S - 1, 0) and program.place(S) == (S - 1, 1)  # the turn: one stage
        V = 2 * S
        unit = Costs(forward=[1.0] * V, backward=[1.0] * V, weight=[1.0] * V, comm=0.0)
        got = simulate(program, unit, "async")
        # each F, B, W a slot: 6M of work a stage, and 2(S - 1) slots of fill (M >= 2S), where ZB-H1 (a
        # stage's F = B = W = 2) idles 4(S - 1) and 1F1B (F = 2, B = 4) 6(S - 1)
        if M >= 2 * S:
            assert got.loop == 6 * M + 2 * (S - 1)
            zb_h1 = simulate(schedule("zb-h1", S, M), Costs(forward=[2.0] * S, backward=[2.0] * S,
                                                            weight=[2.0] * S), "lockstep")
            assert zb_h1.loop == 6 * M + 4 * (S - 1)
        else:
            assert 6 * M < got.loop < 6 * (M + S - 1)
        one = simulate(schedule("1f1b", S, M), Costs.of_micro([6.0] * S, weight_pass=False), "async")
        assert one.loop == 6 * (M + S - 1)
        assert simulate(program, unit, "lockstep").loop == got.loop  # equal actions: lockstep loses nothing
    # a dependency across stages pays the link, the V's turn on one stage does not
    program = zb_v(2, 1)
    far = simulate(program, Costs(forward=[1.0] * 4, backward=[1.0] * 4, weight=[1.0] * 4, comm=10.0), "async")
    # F0 F1 F2 F3 B3 B2 W2 B1 B0 W0 in a chain (a stage runs its one pending W first): stage 0 -> 1 and back
    # forward, again backward, four crossings
    assert far.loop == pytest.approx(10 + 4 * 10.0)


@given(programs())
@FAST
def test_exchanges_send_each_crossing_value_once_after_it_is_made_and_before_it_is_read(
        program: PipelineProgram) -> None:
    S, V, M = program.num_stages, program.num_virtual_stages, program.num_microbatches
    got = exchanges(program)
    crossings = sum(program.place(u)[0] != program.place(u - 1)[0] for u in range(1, V))
    assert len(got) == 2 * crossings * M
    assert len({(e.value, e.virtual_stage, e.microbatch) for e in got}) == len(got)
    for e in got:
        assert e.src != e.dst and e.sent < e.needed
        assert e.dst == program.place(e.virtual_stage)[0]
    # one stage, or a V's turn, sends nothing to itself
    if S == 1:
        assert got == ()


def _replay(program: PipelineProgram, tail_split: int = 1) -> Any:
    """Run ``ticks(program)``'s tables as the SPMD program does, on tokens instead of arrays: each tick a
    stage's forward, backward, weight pass read and write the slots the tables name, then the exchanges
    (without a V: the forward's value one way up, the backward's one way down, round the ring with chunks;
    in a V: each value towards the stage of the virtual stage that reads it, one message each way, kept on
    the stage at the turn) land where the receive tables say; with ``tail_split > 1`` the last virtual stage's
    forward leaves its tail to the next tick, at the end of which the tail's cotangent lands in the slot
    ``tail_cot`` names. Fails on a read of a value not there (not yet written, overwritten, or never sent)
    and on a write over a value that is still to be read; returns the tables."""
    t = ticks(program, tail_split)
    tail_due: dict[int, int] = {}  # tick -> the microbatch whose tail runs then
    S, V, T = program.num_stages, program.num_virtual_stages, t.num_ticks
    wp = t.weight_pass
    ring = program.num_chunks > 1 and not program.v_shape
    size = {"act": t.act_slots, "cot": t.cot_slots, "res": t.res_slots, "g": t.g_slots}
    buf: dict[str, list[list[Any]]] = {k: [[None] * n for _ in range(S)] for k, n in size.items()}
    left: Counter = Counter()  # reads each value still waits for

    def write(s: int, name: str, k: int, token: Any, reads: int, at: int) -> None:
        assert 0 <= k < size[name], f"{name} slot {k} of stage {s} out of range at tick {at}"
        old = buf[name][s][k]
        assert old is None or left[old] == 0, f"{name} slot {k} of stage {s} overwritten at tick {at}: {old} unread"
        buf[name][s][k] = token
        if token is not None:
            left[token] = reads

    def read(s: int, name: str, k: int, token: Any, at: int) -> None:
        got = buf[name][s][int(k)] if 0 <= k < size[name] else "nothing"
        assert got == token and left[token] > 0, f"stage {s} reads {token} at tick {at} from {name} slot {k}: {got}"
        left[token] -= 1

    def u_of(chunk: int, s: int) -> int:
        return int(t.virtual(np.asarray(chunk), np.asarray(s)))

    for at in range(T):
        up: list[Any] = [None] * S
        down: list[Any] = [None] * S
        kept: list[dict[str, Any]] = [{} for _ in range(S)]

        def send(s: int, token: Any, dst: int, kind: str, way: str, at: int = at, up: list[Any] = up,
                 down: list[Any] = down, kept: list[dict[str, Any]] = kept) -> None:
            if program.v_shape:  # towards the stage that reads it
                way = "turn" if dst == s else "up" if dst == s + 1 else "down"
                assert way != "down" or dst == s - 1
            if way == "turn":
                kept[s][kind] = token
                return
            box = up if way == "up" else down
            assert box[s] is None, f"stage {s} sends two values {way} at tick {at}"
            box[s] = token

        for s in range(S):
            if (m := int(t.f_micro[at, s])) >= 0:
                u = u_of(t.f_chunk[at, s], s)
                if u > 0:
                    read(s, "act", t.act_read[at, s], ("stream", u, m), at)
                write(s, "res", int(t.res_write[at, s]), ("res", u, m), 1 + wp, at)
                if u == V - 1 and t.spread:
                    assert t.cot_self[at, s] < 0 and at + 1 not in tail_due
                    tail_due[at + 1] = m
                elif u == V - 1:
                    write(s, "cot", int(t.cot_self[at, s]), ("cot", u, m), 1 + wp, at)
                else:
                    send(s, ("stream", u + 1, m), program.place(u + 1)[0], "act", "up")
            if (m := int(t.b_micro[at, s])) >= 0:
                u = u_of(t.b_chunk[at, s], s)
                read(s, "res", t.res_read[at, s], ("res", u, m), at)
                read(s, "cot", t.cot_read[at, s], ("cot", u, m), at)
                if wp:
                    write(s, "g", int(t.g_write[at, s]), ("g", u, m), 1, at)
                if u > 0:
                    send(s, ("cot", u - 1, m), program.place(u - 1)[0], "cot", "down")
            if wp and (m := int(t.w_micro[at, s])) >= 0:
                u = u_of(t.w_chunk[at, s], s)
                read(s, "res", t.w_res[at, s], ("res", u, m), at)
                read(s, "cot", t.w_cot[at, s], ("cot", u, m), at)
                read(s, "g", t.g_read[at, s], ("g", u, m), at)
        for s in range(S):  # the end of the tick: what arrives, where the tables keep it
            below = up[(s - 1) % S] if ring or s > 0 else None
            above = down[(s + 1) % S] if ring or s < S - 1 else None
            tables = [("act", t.act_recv, below), ("cot", t.cot_recv, above)]
            if program.v_shape:
                tables += [("act", t.act_recv_down, above), ("cot", t.cot_recv_up, below),
                           ("act", t.act_turn, kept[s].get("act")), ("cot", t.cot_turn, kept[s].get("cot"))]
            for name, table, token in tables:
                if (k := int(table[at, s])) >= 0:
                    reads = 1 if name == "act" else 1 + wp
                    write(s, name, k, token, reads, at)
        if t.spread:  # the tail ran on its stages this tick: its cotangent reaches the last virtual stage's
            m = tail_due.pop(at, -1)
            assert int(t.tail_micro[at]) == m, f"tick {at} runs the tail of {int(t.tail_micro[at])}, not {m}"
            if m >= 0:
                write(program.place(V - 1)[0], "cot", int(t.tail_cot[at]), ("cot", V - 1, m), 1 + wp, at)
    assert not +left and not tail_due, f"values never read: {sorted(+left)[:5]}, tails never run: {tail_due}"
    return t


@given(programs(), st.integers(2, 4))
@FAST
def test_tick_tables_deliver_every_value_before_it_is_read_and_keep_it_until_then(program: PipelineProgram,
                                                                                 split: int) -> None:
    _replay(program)
    if program.tail_gap and split <= program.num_stages:  # the tail spread over `split` stages
        t = _replay(program, split)
        assert list(t.tail_stages()) == (list(range(split)) if program.v_shape else
                                         list(range(program.num_stages - split, program.num_stages)))


def test_zb_v_ticks_lay_out_both_ways_and_hold_1f1bs_activations() -> None:
    for S, M in ((1, 3), (2, 1), (2, 4), (3, 5), (4, 8), (4, 32), (8, 16)):
        program = zb_v(S, M)
        t = _replay(program)
        assert t.num_ticks == len(program.slots) and t.v_shape
        # residuals live from F to W, at most 2S chunk-microbatches a stage (the builder's cap): a chunk is
        # half a stage, so 1F1B's first stage's S whole microbatches, whatever M; and one W's inputs at a time
        assert t.res_slots <= min(2 * S, 2 * M) and t.g_slots == 1 and t.cot_slots <= 2
        if S > 1:  # the turn keeps its values on stage S - 1; chunk 1's come the other way
            assert (t.act_turn[:, S - 1] >= 0).sum() == M and (t.act_turn[:, : S - 1] < 0).all()
            assert (t.cot_turn[:, S - 1] >= 0).sum() == M
            assert (t.act_recv_down >= 0).sum() == (S - 1) * M == (t.cot_recv_up >= 0).sum()
    with pytest.raises(ValueError, match=r"tail spread over 2 stages needs a schedule built with tail_gap=1"):
        ticks(zb_v(2, 4), 2)


def test_zb_v_spreads_its_tail_from_stage_0_at_1f1bs_memory_for_a_few_more_ticks() -> None:
    # the last virtual stage (stage 0's second chunk) leaves a tick for the tail, which runs on stages 0..G-1;
    # the V still holds at most 2S chunk-microbatches a stage, and the gap costs at most 2S ticks, whatever M
    # (GPT-1T's 64 stages over 512 microbatches: 3325 against 3198)
    for S, M in ((2, 4), (3, 5), (4, 8), (4, 32), (8, 16)):
        program, plain = zb_v(S, M, 1), zb_v(S, M)
        program.verify()
        assert program.tail_gap == 1 and program.peak_inflight_all() == plain.peak_inflight_all()
        assert len(plain.slots) < len(program.slots) <= len(plain.slots) + 2 * S
        t = _replay(program, min(S, 2))
        assert int((t.tail_micro >= 0).sum()) == M and list(t.tail_stages()) == [0, 1]
        # priced: the tail's seconds leave the last chunk's actions for the tail ticks on stages 0 and 1
        V, tail = 2 * S, 3.0
        with_tail = Costs.of_micro([6.0] * (V - 1) + [6.0 + tail], weight_pass=True)
        spread = Costs.of_micro([6.0] * V, weight_pass=True, tail=tail)
        got, kept = simulate(program, spread, "lockstep", tail_split=2), simulate(plain, with_tail, "lockstep")
        assert got.busy[0] == got.busy[1] == pytest.approx((2 * 6.0 + tail / 2) * M)  # two chunks, half a tail
        assert all(b == pytest.approx(2 * 6.0 * M) for b in got.busy[2:])
        # the spread pays once the microbatches outnumber the gap's ticks (S = 8, M = 16: 270 against 268)
        assert got.loop < kept.loop or M <= 2 * S


def test_a_program_draws_as_a_grid_whole_or_as_a_window_of_its_first_slots_and_outer_stages() -> None:
    whole = str(zb_h1(3, 4))
    assert whole.splitlines() == [
        "zb-h1: 3 stages, 4 microbatches, 16 slots",
        "stage 0: F0 F1 F2 .  .  B0 W0 F3 B1 W1 .  B2 W2 .  B3 W3",
        "stage 1: .  F0 F1 .  B0 W0 F2 B1 W1 F3 B2 W2 .  B3 W3 .",
        "stage 2: .  .  F0 B0 W0 F1 B1 W1 F2 B2 W2 F3 B3 W3 .  .",
    ]
    assert str(fused_1f1b(2, 2)).splitlines()[2] == "stage 1: .     F0+B0 F1+B1 ."  # a forward, then a backward
    program = schedule("1f1b", 12, 24)
    lines = program.draw(max_slots=5, max_stages=4).splitlines()
    assert lines[0] == f"1f1b: 12 stages, 24 microbatches, {len(program.slots)} slots (the first 5 drawn)"
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["stage 0", "stage 1", "⋮", "stage 10", "stage 11"]
    assert lines[1] == "stage 0:  F0 F1 F2 F3 F4 …" and lines[-1] == "stage 11: .  .  .  .  .  …"
    assert program.draw(max_slots=10 ** 6, max_stages=12) == str(program)  # a window as large as it: the whole


def test_a_schedule_by_name_is_1f1b_as_fused_ticks_where_asked_and_only_for_1f1b() -> None:
    # one rule for a plan's program, the SPMD program's and its price's tables (``PipelinePlan.program``)
    assert schedule("1f1b", 3, 4, fused=True) == fused_1f1b(3, 4)
    assert schedule("1f1b", 3, 4, tail_gap=1, fused=True) == fused_1f1b(3, 4, 1)
    with pytest.raises(ValueError, match="only '1f1b' runs as fused ticks"):
        schedule("zb-h1", 3, 4, fused=True)

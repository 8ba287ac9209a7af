"""ZB-H1 as plain data: valid, as much memory as 1F1B, fewer idle slots (no JAX)."""

from __future__ import annotations

import pytest

from autoshard.pipeline.schedules import Action, Schedule, one_f_one_b, schedule, zb_h1


@pytest.mark.parametrize(("S", "B"), [(1, 1), (2, 4), (4, 4), (4, 8), (3, 7), (8, 16), (4, 2)])
def test_zb_h1_is_valid_and_holds_what_1f1b_holds(S: int, B: int) -> None:
    z = zb_h1(S, B)
    z.verify()
    assert z.weight_pass and len([a for slot in z.slots for a in slot]) == 3 * S * B
    assert [z.peak_inflight(s) for s in range(S)] == [one_f_one_b(S, B).peak_inflight(s) for s in range(S)]
    for s in range(S):  # every stage runs F, B, W of each microbatch, W right after its B or later
        acts = z.actions(s)
        for m in range(B):
            kinds = [a.kind for a in acts if a.microbatch == m]
            assert kinds == ["forward", "backward", "weight"]


@pytest.mark.parametrize(("S", "B"), [(2, 4), (4, 8), (8, 16)])
def test_zb_h1_idles_less_than_1f1b_for_the_same_work(S: int, B: int) -> None:
    # same forward time, same total backward time (input gradient + weight gradient = 2 forwards)
    z, o = zb_h1(S, B), one_f_one_b(S, B)
    assert z.bubble_fraction(1.0, 2.0) < o.bubble_fraction(1.0, 2.0)
    V = S
    sim = z.simulate([1.0] * V, [1.0] * V, weight_times=[1.0] * V)
    assert sim.makespan < o.simulate([1.0] * V, [2.0] * V).makespan


def test_a_weight_pass_before_its_backward_is_refused() -> None:
    z = zb_h1(2, 2)
    slots = [list(slot) for slot in z.slots]
    # swap stage 1's first B and W
    flat = [(t, i) for t, slot in enumerate(slots) for i, a in enumerate(slot) if a.stage == 1 and a.microbatch == 0
            and a.kind in ("backward", "weight")]
    (tb, ib), (tw, iw) = flat
    slots[tb][ib], slots[tw][iw] = slots[tw][iw], slots[tb][ib]
    bad = Schedule(name="zb-h1", num_stages=2, num_microbatches=2, weight_pass=True,
                   slots=tuple(tuple(s) for s in slots))
    with pytest.raises(ValueError, match=r"weight of microbatch 0 at virtual stage 1 in slot .* must come after"):
        bad.verify()
    missing = Schedule(name="zb-h1", num_stages=1, num_microbatches=1, weight_pass=True,
                       slots=((Action(0, 0, "forward"),), (Action(0, 0, "backward"),)))
    with pytest.raises(ValueError, match="missing weight of microbatch 0"):
        missing.verify()
    no_split = Schedule(name="1f1b", num_stages=1, num_microbatches=1,
                        slots=((Action(0, 0, "forward"),), (Action(0, 0, "backward"),), (Action(0, 0, "weight"),)))
    with pytest.raises(ValueError, match="has kind 'weight'"):
        no_split.verify()


def test_zb_h1_round_trips_and_needs_weight_times() -> None:
    z = schedule("zb-h1", 4, 8)
    assert Schedule.from_dict(z.to_dict()) == z
    with pytest.raises(ValueError, match="pass weight_times"):
        z.simulate([1.0] * 4, [1.0] * 4)
    assert "W3" in str(z)

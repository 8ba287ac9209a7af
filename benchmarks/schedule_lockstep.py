"""Which schedules fill the SPMD program's lockstep ticks, priced by ``solvers.pipeline.simulate`` on equal
stages (issue #47 item 6): 1F1B, ZB-H1, interleaved 1F1B, ZB-V, and an interleaved ZB-H1 built here (interleaved
1F1B's order with every backward split into ``B`` and its ``W`` right after it, as ZB-H1 splits 1F1B's), each
in lockstep and asynchronously, with the most (chunk-)microbatches a stage holds.

    python benchmarks/schedule_lockstep.py [--stages 4 8 16] [--microbatches 16 64 128]

Units: a stage's forward and backward of one microbatch take 1 (``f = 1/3``, ``b = 2/3``, or ``b = w = 1/3``
with a weight pass; a chunk of ``v`` takes ``1/v`` of it); exchanges left out. Pure: no JAX.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solvers.pipeline.lowering import action_tables
from solvers.pipeline.program import Action, PipelineProgram
from solvers.pipeline.schedules import (
    interleaved_1f1b,
    one_f_one_b,
    pack,
    zb_h1,
    zb_v,
)
from solvers.pipeline.simulate import Costs, simulate


def interleaved_zb_h1(S: int, M: int, v: int = 2) -> PipelineProgram:
    """Interleaved 1F1B's per-stage order (``schedules.interleaved_1f1b``) with each backward followed by its
    weight pass: ZB-H1's split applied to Megatron's interleaving."""
    base = interleaved_1f1b(S, M, v)
    orders: list[list[Action]] = [[] for _ in range(S)]
    for s, order in enumerate(_orders(base, S)):
        for a in order:
            orders[s].append(a)
            if a.kind == "backward":
                orders[s].append(Action(a.stage, a.microbatch, "weight", a.chunk))
    return pack("interleaved-zb-h1", S, M, v, orders, weight_pass=True)


def _orders(program: PipelineProgram, S: int) -> list[list[Action]]:
    out: list[list[Action]] = [[] for _ in range(S)]
    for slot in program.slots:
        for a in slot:
            out[a.stage].append(a)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[16, 64, 128])
    args = ap.parse_args()
    print("| S | M | schedule | lockstep | async | lockstep / M | most in flight (chunk-microbatches) |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for S in args.stages:
        for M in args.microbatches:
            if M % S:
                continue
            for name, program in (("1f1b", one_f_one_b(S, M)), ("zb-h1", zb_h1(S, M)),
                                  ("interleaved-1f1b", interleaved_1f1b(S, M, 2)),
                                  ("interleaved-zb-h1", interleaved_zb_h1(S, M)), ("zb-v", zb_v(S, M))):
                V = program.num_virtual_stages
                costs = Costs.of_micro([S / V] * V, weight_pass=program.weight_pass)
                lock = simulate(action_tables(program), costs, "lockstep")
                run = simulate(program, costs, "async")
                print(f"| {S} | {M} | {name} | {lock.loop:.2f} | {run.loop:.2f} | {lock.loop / M:.3f} | "
                      f"{max(lock.inflight)} |")


if __name__ == "__main__":
    main()

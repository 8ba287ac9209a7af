"""Rules for ops with a fixed layout: FFTs and host callbacks.

An FFT transforms its last ``len(fft_lengths)`` dimensions whole (XLA's GPU FFT runs on one device's
buffer; splitting a transformed dimension would need a distributed FFT), so those stay unsplit and the
batch dimensions may be split as for an elementwise op. A host callback (``jax.debug.print``,
``jax.debug.callback``, ``io_callback``, ``pure_callback``) sees whole values on the host: its operands
are gathered (replicated), which is a deliberate layout, not a missing rule.
"""

from __future__ import annotations

from autoshard.strategies.registry import Candidate, RuleContext, fallback_candidate, passthrough, register
from autoshard.trace.costs import CALLBACKS
from autoshard.trace.graph import Op


@register("fft")
def fft(op: Op, ctx: RuleContext) -> list[Candidate]:
    rank = len(ctx.out_shapes(op)[0])
    transformed = len(tuple(op.eqn.params.get("fft_lengths", ()))) or 1
    return passthrough(op, ctx, set(range(rank - transformed, rank)))


@register(*CALLBACKS)
def host_callback(op: Op, ctx: RuleContext) -> list[Candidate]:
    return [fallback_candidate(op, ctx)]

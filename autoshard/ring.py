"""Attention split along the sequence: a ring of blockwise attentions, zig-zag balanced when causal.

``ring_attention(block, backward)`` turns a *block* attention (a fused kernel, or ``reference_block``) into
causal self-attention over ``[batch, seq, heads, head_dim]`` that the planner may split over batch and heads
(each device runs the block on its shard, as ``splittable`` does) and along the sequence (context
parallelism). Split along the sequence over ``n`` devices (mesh axes ``A``), one call runs, per device:

1. **Zig-zag.** The sequence is ``2n`` chunks of ``c = S / 2n``. A contiguous layout gives device ``i``
   chunks ``2i, 2i + 1``; causal work is then lopsided (the last device's queries see every key, the first's
   almost none). Two ``ppermute``s over ``A`` give device ``j`` chunks ``j`` and ``2n - 1 - j`` instead
   (``z(m) = m`` if ``m < n`` else ``2n - 1 - m`` is chunk ``m``'s device; ``m -> z(2i)`` and ``m -> z(2i + 1)``
   are permutations of the devices), for the queries and for the keys and values. Positions still increase
   along the local ``[low, high] = [chunk j, chunk 2n - 1 - j]``.
2. **Diagonal.** ``block(q, k, v, causal=True)`` on the local ``2c`` rows: causal within ``[low, high]``.
3. **Ring.** ``n - 1`` times: the keys and values move one device on (``i -> i + 1``), so at step ``s`` device
   ``j`` holds those of ``r = (j - s) mod n``. If ``r < j``, both local query chunks see key chunk ``r``
   whole and neither sees ``2n - 1 - r``; if ``r > j``, only the high query chunk sees keys, both of ``r``'s
   chunks whole. Either way two ``c x c`` blocks, non-causal: ``(q_high, k_low)`` always, and
   ``(q_low, k_low)`` if ``r < j`` else ``(q_high, k_high)`` (a select, no branch): every device does the
   same work at every step, ``2c^2`` (query, key) pairs, which is the causal total ``S^2 / 2`` over ``n``.
4. **Merge.** Partial results combine by their row log-sum-exps:
   ``l = logaddexp(l_1, l_2)``, ``o = o_1 e^{l_1 - l} + o_2 e^{l_2 - l}`` (in fp32), a block's rows it did not
   compute entering with ``l_2 = -inf``.
5. The result (and its log-sum-exp, which the backward needs) return to the contiguous layout by the
   inverse permutations.

Without a causal mask (``causal=False``: every query sees every key) the contiguous shards are balanced
already: no zig-zag, and each step is one block of the local queries over the keys that came.

The backward is a second call (``ring_attention``'s ``custom_vjp``) with the same ring: each block's
gradients from ``backward(q, k, v, out, lse, dout, causal)`` with the *global* rows' ``out`` and ``lse``
(``p = e^{s - lse}`` is then the true softmax); ``dq`` accumulates locally, ``dk`` and ``dv`` travel with
their keys and values and take one more hop home at the end.

Per device: ``S/n`` of the queries and at most two key shards at a time, never ``[S, S]`` nor the whole
keys; ``(n - 1)`` shards of K and V sent (``dK``, ``dV`` too in the backward), each hop independent of the
block computed beside it, so that XLA can overlap them; the zig-zag permutations' sends are not hidden.
``strategies.custom`` prices it so (``Ring``, attached to the call's partition callback).

Shapes: ``q, k, v, out, dout: [b, s, h, d]``; ``lse: float32 [b, h, s]``. ``block(q, k, v, causal)`` takes
``q [b, sq, h, d]`` and ``k, v [b, sk, h, d]`` and returns ``(out [b, sq, h, d], lse [b, h, sq])``; with
``causal`` (``sq == sk``) query ``i`` sees keys ``<= i``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Block = Callable[[jax.Array, jax.Array, jax.Array, bool], tuple[jax.Array, jax.Array]]
BlockBackward = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
SEQ = 1  # the sequence dimension of q, k, v, out, dout
LSE_SEQ = 2  # of lse [b, h, s]


@dataclasses.dataclass(frozen=True, slots=True)
class Ring:
    """What the planner needs of a ring call (``strategies.custom``): its sequence ``factor``; the operands
    that go round the ring (``travel``: the keys and values) and the results that go round with them and
    home (``back``: their gradients); whether ``block`` skips fully masked work (``skips_masked``: the
    traced call's flops are then the causal total, else the whole ``S x S``)."""

    factor: str
    travel: tuple[int, ...]
    back: tuple[int, ...] = ()
    skips_masked: bool = True
    causal: bool = True

    def work_share(self, n: int) -> float:
        """The share of the traced call's flops one of ``n`` devices computes (module docstring): ``1/n``
        with a kernel that skips masked blocks, or no mask; else the diagonal's ``(2c)^2`` and ``n - 1``
        steps of ``2c^2`` against the traced ``S^2 = (2nc)^2``: ``(n + 1) / (2 n^2)``."""
        return 1.0 / n if self.skips_masked or not self.causal or n == 1 else (n + 1) / (2.0 * n * n)


# ---- the reference block (jnp; its scores materialised per block) --------------------------------------


def _scores(q: jax.Array, k: jax.Array, causal: bool) -> jax.Array:
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, jnp.finfo(jnp.float32).min)
    return s


def reference_block(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of ``q`` over ``k, v`` (scale ``head_dim**-0.5``) with its row log-sum-exps, the
    ``[b, h, sq, sk]`` scores materialised in fp32: what a fused kernel computes, written in jnp."""
    s = _scores(q, k, causal)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype), lse


def reference_block_backward(q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array,
                             dout: jax.Array, causal: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``reference_block``'s gradients for one block, given the rows' *global* ``out`` and ``lse``:
    ``p = e^{s - lse}``, ``dv = pᵀ dO``, ``ds = p (dO vᵀ - rowsum(O dO))``, ``dq = ds k / √d``,
    ``dk = dsᵀ q / √d``."""
    scale = q.shape[-1] ** -0.5
    p = jnp.exp(_scores(q, k, causal) - lse[..., None])
    f32 = jnp.float32
    dv = jnp.einsum("bhqk,bqhd->bkhd", p.astype(dout.dtype), dout, preferred_element_type=f32)
    dp = jnp.einsum("bqhd,bkhd->bhqk", dout, v, preferred_element_type=f32)
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(f32), dout.astype(f32))
    ds = p * (dp - delta[..., None])
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, k.astype(f32)) * scale
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(f32)) * scale
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ---- the zig-zag layout ----------------------------------------------------------------------------------


def _owner(m: int, n: int) -> int:
    """The device that holds chunk ``m`` of ``2n`` in the zig-zag layout."""
    return m if m < n else 2 * n - 1 - m


def _to_zigzag(x: jax.Array, axis: int, axes: Any, n: int) -> tuple[jax.Array, jax.Array]:
    """A contiguous shard (chunks ``2i, 2i + 1`` along ``axis``) -> this device's ``(chunk j, chunk 2n-1-j)``."""
    first, second = jnp.split(x, 2, axis=axis)
    a = lax.ppermute(first, axes, [(i, _owner(2 * i, n)) for i in range(n)])
    b = lax.ppermute(second, axes, [(i, _owner(2 * i + 1, n)) for i in range(n)])
    even = lax.axis_index(axes) % 2 == 0  # chunk j came as a first half iff j is even
    return jnp.where(even, a, b), jnp.where(even, b, a)


def _from_zigzag(low: jax.Array, high: jax.Array, axis: int, axes: Any, n: int) -> jax.Array:
    """``_to_zigzag``'s inverse: each chunk back to its contiguous device and place."""
    even = lax.axis_index(axes) % 2 == 0
    first = lax.ppermute(jnp.where(even, low, high), axes, [(_owner(2 * i, n), i) for i in range(n)])
    second = lax.ppermute(jnp.where(even, high, low), axes, [(_owner(2 * i + 1, n), i) for i in range(n)])
    return jnp.concatenate([first, second], axis=axis)


def _merge(o1: jax.Array, l1: jax.Array, o2: jax.Array, l2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two partial attentions of the same rows (fp32 ``o [b, q, h, d]``, ``l [b, h, q]``) as one."""
    lse = jnp.logaddexp(l1, l2)

    def weight(x: jax.Array) -> jax.Array:
        return jnp.swapaxes(jnp.exp(x - lse), 1, 2)[..., None]

    return o1 * weight(l1) + o2.astype(jnp.float32) * weight(l2), lse


def _halves(x: jax.Array, axis: int = SEQ) -> list[jax.Array]:
    return jnp.split(x, 2, axis=axis)


# ---- one device's program ---------------------------------------------------------------------------------


def ring_forward(block: Block, axes: Any, n: int, q: jax.Array, k: jax.Array, v: jax.Array,
                 causal: bool = True) -> tuple[jax.Array, jax.Array]:
    """One device's forward (module docstring), its contiguous shards in, ``(out, lse)`` shards out. Not
    ``causal``: every query sees every key, so the contiguous shards are balanced as they are and each step
    is one block of the local queries over the keys that came."""
    if n == 1:
        return block(q, k, v, causal)
    ring = [(i, (i + 1) % n) for i in range(n)]
    if not causal:
        o, lse = block(q, k, v, False)
        o = o.astype(jnp.float32)
        for _ in range(1, n):
            k, v = lax.ppermute((k, v), axes, ring)
            o, lse = _merge(o, lse, *block(q, k, v, False))
        return o.astype(q.dtype), lse
    j = lax.axis_index(axes)
    ql, qh = _to_zigzag(q, SEQ, axes, n)
    kl, kh = _to_zigzag(k, SEQ, axes, n)
    vl, vh = _to_zigzag(v, SEQ, axes, n)
    o, lse = block(jnp.concatenate([ql, qh], SEQ), jnp.concatenate([kl, kh], SEQ),
                   jnp.concatenate([vl, vh], SEQ), True)
    ol, oh = _halves(o.astype(jnp.float32))
    ll, lh = _halves(lse, LSE_SEQ)
    none = jnp.float32(-jnp.inf)
    for s in range(1, n):
        kl, kh, vl, vh = lax.ppermute((kl, kh, vl, vh), axes, ring)
        early = (j - s) % n < j  # the keys came from a device before this one
        oa, la = block(qh, kl, vl, False)
        ob, lb = block(jnp.where(early, ql, qh), jnp.where(early, kl, kh), jnp.where(early, vl, vh), False)
        oh, lh = _merge(oh, lh, oa, la)
        ol, ll = _merge(ol, ll, ob, jnp.where(early, lb, none))
        oh, lh = _merge(oh, lh, ob, jnp.where(early, none, lb))
    out = _from_zigzag(ol.astype(q.dtype), oh.astype(q.dtype), SEQ, axes, n)
    return out, _from_zigzag(ll, lh, LSE_SEQ, axes, n)


def ring_backward(backward: BlockBackward, axes: Any, n: int, q: jax.Array, k: jax.Array, v: jax.Array,
                  out: jax.Array, lse: jax.Array, dout: jax.Array,
                  causal: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One device's backward (module docstring): ``(dq, dk, dv)`` shards."""
    if n == 1:
        return backward(q, k, v, out, lse, dout, causal)
    f32 = jnp.float32
    ring = [(i, (i + 1) % n) for i in range(n)]
    if not causal:
        dq, dk, dv = (g.astype(f32) for g in backward(q, k, v, out, lse, dout, False))
        for _ in range(1, n):
            k, v, dk, dv = lax.ppermute((k, v, dk, dv), axes, ring)
            gq, gk, gv = backward(q, k, v, out, lse, dout, False)
            dq, dk, dv = dq + gq.astype(f32), dk + gk.astype(f32), dv + gv.astype(f32)
        dk, dv = lax.ppermute((dk, dv), axes, ring)  # home: one hop more
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
    j = lax.axis_index(axes)
    ql, qh = _to_zigzag(q, SEQ, axes, n)
    kl, kh = _to_zigzag(k, SEQ, axes, n)
    vl, vh = _to_zigzag(v, SEQ, axes, n)
    ol, oh = _to_zigzag(out, SEQ, axes, n)
    dl, dh = _to_zigzag(dout, SEQ, axes, n)
    Ll, Lh = _to_zigzag(lse, LSE_SEQ, axes, n)

    def cat(a: jax.Array, b: jax.Array, axis: int = SEQ) -> jax.Array:
        return jnp.concatenate([a, b], axis)

    dq, dk, dv = (g.astype(f32) for g in backward(cat(ql, qh), cat(kl, kh), cat(vl, vh), cat(ol, oh),
                                                  cat(Ll, Lh, LSE_SEQ), cat(dl, dh), True))
    (dql, dqh), (dkl, dkh), (dvl, dvh) = _halves(dq), _halves(dk), _halves(dv)
    for s in range(1, n):
        kl, kh, vl, vh, dkl, dkh, dvl, dvh = lax.ppermute((kl, kh, vl, vh, dkl, dkh, dvl, dvh), axes, ring)
        early = (j - s) % n < j

        def pick(a: jax.Array, b: jax.Array) -> jax.Array:
            return jnp.where(early, a, b)  # noqa: B023 (used at once, in this iteration)

        ga = backward(qh, kl, vl, oh, Lh, dh, False)
        gb = backward(pick(ql, qh), pick(kl, kh), pick(vl, vh), pick(ol, oh), pick(Ll, Lh), pick(dl, dh), False)
        (dqa, dka, dva), (dqb, dkb, dvb) = ((g.astype(f32) for g in x) for x in (ga, gb))
        zero = jnp.zeros_like(dqb)
        dql, dqh = dql + pick(dqb, zero), dqh + dqa + pick(zero, dqb)
        dkl, dkh = dkl + dka + pick(dkb, zero), dkh + pick(zero, dkb)
        dvl, dvh = dvl + dva + pick(dvb, zero), dvh + pick(zero, dvb)
    dkl, dkh, dvl, dvh = lax.ppermute((dkl, dkh, dvl, dvh), axes, ring)  # home: one hop more
    return tuple(_from_zigzag(lo.astype(x.dtype), hi.astype(x.dtype), SEQ, axes, n)
                 for lo, hi, x in ((dql, dqh, q), (dkl, dkh, k), (dvl, dvh, v)))


def check_shapes(q: Any, k: Any, v: Any, where: str = "ring_attention") -> None:
    """Self-attention on ``[b, s, h, d]``: the same shape for q, k and v."""
    shapes: Sequence[Any] = [tuple(x.shape) for x in (q, k, v)]
    if len(shapes[0]) != 4 or len(set(shapes)) != 1:
        raise ValueError(f"{where}: q, k and v must be [batch, seq, heads, head_dim] of one shape (causal "
                         f"self-attention), got {', '.join(map(str, map(list, shapes)))}")

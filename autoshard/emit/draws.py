"""A random draw computed as one block of rows of a larger draw (``offset_bits``): how a pipeline's microbatch
draws the numbers ``jax.jit`` draws over the whole batch (``pipeline.draws`` says which draws and why this is
exact: threefry's partitionable bits depend on an element's flat index only)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

DRAW = "random_bits"


def offset_bits(key: jax.Array, bit_width: int, shape: tuple[int, ...], block: jax.Array) -> jax.Array:
    """``random_bits(key, bit_width, shape)`` as rows ``block·shape[0] .. (block+1)·shape[0]`` of the draw
    over ``(n·shape[0], *shape[1:])``, any ``n > block``: threefry on the flat indices ``block·N + e``
    (``N`` the elements of ``shape``), as jax's partitionable threefry computes them."""
    data = jax.random.key_data(key)
    k1, k2 = data[..., 0], data[..., 1]
    n = math.prod(shape)
    hi_n, lo_n = _mul64(jnp.asarray(block, jnp.uint32), n)
    local = jax.lax.iota(np.uint32, n).reshape(shape)
    lo = local + lo_n
    hi = jnp.broadcast_to(hi_n + (lo < local).astype(jnp.uint32), shape)
    bits1, bits2 = threefry2x32_p.bind(k1, k2, hi, lo)
    if bit_width == 64:
        return (bits1.astype(jnp.uint64) << jnp.uint64(32)) | bits2.astype(jnp.uint64)
    out = bits1 ^ bits2
    return out if bit_width == 32 else out.astype(np.dtype(f"uint{bit_width}"))


def _mul64(a: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """``a · n`` as (high, low) 32-bit words, for a uint32 scalar ``a`` and ``0 <= n < 2**32``, in 16-bit limbs
    (no 64-bit integers without ``jax_enable_x64``)."""
    m16 = jnp.uint32(0xFFFF)
    al, ah = a & m16, a >> jnp.uint32(16)
    nl, nh = jnp.uint32(n & 0xFFFF), jnp.uint32(n >> 16)
    p0, p1, p2, p3 = al * nl, al * nh, ah * nl, ah * nh
    mid = p1 + p2
    carry_mid = (mid < p1).astype(jnp.uint32)
    lo = p0 + (mid << jnp.uint32(16))
    carry_lo = (lo < p0).astype(jnp.uint32)
    hi = p3 + (mid >> jnp.uint32(16)) + (carry_mid << jnp.uint32(16)) + carry_lo
    return hi, lo

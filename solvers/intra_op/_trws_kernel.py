"""The compiled passes of ``trws`` (numba, cached on disk): imported only when a solve runs them.

Kept apart for the reasons of ``_anneal_kernel``: importing ``solvers`` never needs numba, and numba caches
module-level functions. Layout as ``anneal._Flat``: adjacency entry ``p`` of node ``a`` (neighbour
``adj_nbr[p]``) has ``R^ab(s, u)`` at ``omats[adj_omoff[p] + s * k_b + u]``; ``rev[p]`` is the entry of ``b``
that points back at ``a``; ``msg[moff[p]:moff[p] + k_a]`` is the message into ``a`` along entry ``p``."""

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def unary(a, k, koff, theta, adj_off, moff, msg, out, at):
    # node a's reparametrised unary theta_a + Σ_b M_{b→a}, written to out[at:at + k[a]]
    for s in range(k[a]):
        out[at + s] = theta[koff[a] + s]
    for p in range(adj_off[a], adj_off[a + 1]):
        mp = moff[p]
        for s in range(k[a]):
            out[at + s] += msg[mp + s]


@njit(cache=True, nogil=True)
def sweep(order, pos, k, koff, theta, adj_off, adj_nbr, adj_omoff, omats, rev, moff, msg, gamma, h, forward):
    # one pass of TRW-S over the nodes in ``order`` (reversed when not ``forward``): each node's
    # reparametrised unary h = theta + its incoming messages, then its messages to the neighbours after it
    # in the pass's direction, normalised to a minimum of 0
    n = order.shape[0]
    for idx in range(n):
        a = order[idx] if forward else order[n - 1 - idx]
        ka = k[a]
        unary(a, k, koff, theta, adj_off, moff, msg, h, 0)
        ga = gamma[a]
        for p in range(adj_off[a], adj_off[a + 1]):
            b = adj_nbr[p]
            if (pos[b] > pos[a]) != forward:
                continue
            kb = k[b]
            out = moff[rev[p]]
            mp = moff[p]
            for u in range(kb):
                msg[out + u] = np.inf
            row = adj_omoff[p]
            for s in range(ka):
                base = ga * h[s] - msg[mp + s]
                r = row + s * kb
                for u in range(kb):
                    v = base + omats[r + u]
                    if v < msg[out + u]:
                        msg[out + u] = v
            lo = msg[out]
            for u in range(1, kb):
                if msg[out + u] < lo:
                    lo = msg[out + u]
            for u in range(kb):
                msg[out + u] -= lo


@njit(cache=True, nogil=True)
def decode(order, pos, k, koff, theta, adj_off, adj_nbr, adj_omoff, omats, moff, msg, x, h):
    # a point from the messages: in ``order``, each node takes the argmin of its unary, the edge costs to the
    # neighbours already decided, and the messages from those not yet decided
    n = order.shape[0]
    for idx in range(n):
        a = order[idx]
        ka = k[a]
        base_a = koff[a]
        for s in range(ka):
            h[s] = theta[base_a + s]
        for p in range(adj_off[a], adj_off[a + 1]):
            b = adj_nbr[p]
            if pos[b] < pos[a]:
                kb = k[b]
                r = adj_omoff[p] + x[b]
                for s in range(ka):
                    h[s] += omats[r + s * kb]
            else:
                mp = moff[p]
                for s in range(ka):
                    h[s] += msg[mp + s]
        best = 0
        for s in range(1, ka):
            if h[s] < h[best]:
                best = s
        x[a] = best


@njit(cache=True, nogil=True)
def chain_bound(k, koff, theta, adj_off, adj_omoff, omats, rev, moff, msg, share, chain_off, chain_nodes,
                chain_entries, hbar, v, w):
    # TRW-S's lower bound: the messages' reparametrisation θ̄_a = θ_a + Σ_b M_{b→a}, θ̄_ab(s, u) = R^ab(s, u)
    # − M_{a→b}(u) − M_{b→a}(s) (the same energy at every point) split into monotonic chains, node a's unary
    # shared equally by the share[a] = 1 / n_a chains through it; the sum of the chains' minima (a DP along
    # each) is below the minimum of their sum
    n = k.shape[0]
    for a in range(n):
        unary(a, k, koff, theta, adj_off, moff, msg, hbar, koff[a])
    total = 0.0
    for c in range(chain_off.shape[0] - 1):
        a = chain_nodes[chain_off[c]]
        for s in range(k[a]):
            v[s] = share[a] * hbar[koff[a] + s]
        for i in range(chain_off[c] + 1, chain_off[c + 1]):
            b = chain_nodes[i]
            p = chain_entries[i]  # entry of a (the previous node) pointing at b
            ka = k[a]
            kb = k[b]
            into_a = moff[p]
            into_b = moff[rev[p]]
            row = adj_omoff[p]
            for u in range(kb):
                w[u] = np.inf
            for s in range(ka):
                base = v[s] - msg[into_a + s]
                r = row + s * kb
                for u in range(kb):
                    val = base + omats[r + u]
                    if val < w[u]:
                        w[u] = val
            for u in range(kb):
                v[u] = w[u] - msg[into_b + u] + share[b] * hbar[koff[b] + u]
            a = b
        best = np.inf
        for s in range(k[a]):
            if v[s] < best:
                best = v[s]
        total += best
    return total

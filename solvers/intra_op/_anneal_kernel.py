"""The compiled inner loop of ``anneal`` (numba, cached on disk): imported only when a solve anneals.

Kept apart so that importing ``solvers`` never needs numba, and so that numba can cache these functions
(it caches module-level functions, not closures)."""

import math

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def seg_add(mx, lz, size, lo, hi, d):
    # iterative range add on [lo, hi) over a perfect binary tree of ``size`` leaves; mx[i] is the max
    # of the subtree including lz[i] (lz applies to the whole subtree below i, already in mx[i])
    l0 = lo + size
    r0 = hi + size
    left = l0
    right = r0
    while left < right:
        if left & 1:
            mx[left] += d
            lz[left] += d
            left += 1
        if right & 1:
            right -= 1
            mx[right] += d
            lz[right] += d
        left >>= 1
        right >>= 1
    # pull up from the two boundary leaves, side by side (they are at one depth) until their paths meet,
    # then once to the root
    i = l0 >> 1
    j = (r0 - 1) >> 1
    while i != j:
        mx[i] = max(mx[2 * i], mx[2 * i + 1]) + lz[i]
        mx[j] = max(mx[2 * j], mx[2 * j + 1]) + lz[j]
        i >>= 1
        j >>= 1
    while i >= 1:
        mx[i] = max(mx[2 * i], mx[2 * i + 1]) + lz[i]
        i >>= 1


@njit(cache=True, nogil=True)
def delta_of(a, t, x, k, koff, cost, adj_off, adj_nbr, adj_omoff, omats):
    # the exact cost change of node a alone going to t, from the edge matrices (sample_uphill)
    s = x[a]
    d = cost[koff[a] + t] - cost[koff[a] + s]
    for p in range(adj_off[a], adj_off[a + 1]):
        b = adj_nbr[p]
        row = adj_omoff[p] + x[b]
        kb = k[b]
        d += omats[row + t * kb] - omats[row + s * kb]
    return d


@njit(cache=True, nogil=True)
def local_costs(x, k, koff, cost, adj_off, adj_nbr, adj_omoff, omats, loc):
    # loc[koff[a] + s] = c_a(s) + Σ_b R^ab(s, x_b): node a's cost at each of its strategies, its neighbours
    # where they stand
    for a in range(x.shape[0]):
        ka = k[a]
        base = koff[a]
        for s in range(ka):
            loc[base + s] = cost[base + s]
        for p in range(adj_off[a], adj_off[a + 1]):
            b = adj_nbr[p]
            kb = k[b]
            row = adj_omoff[p] + x[b]
            for s in range(ka):
                loc[base + s] += omats[row + s * kb]


@njit(cache=True, nogil=True)
def shift(b, s_old, s_new, k, koff, adj_off, adj_nbr, adj_omoff, omats, loc):
    # node b goes from s_old to s_new: each neighbour's local costs change by a row of their edge's matrix
    # (oriented from b's side, so the row is contiguous)
    for p in range(adj_off[b], adj_off[b + 1]):
        c = adj_nbr[p]
        kc = k[c]
        new = adj_omoff[p] + s_new * kc
        old = adj_omoff[p] + s_old * kc
        base = koff[c]
        for u in range(kc):
            loc[base + u] += omats[new + u] - omats[old + u]


@njit(cache=True, nogil=True)
def best_response(b, k, koff, price, loc):
    # argmin_s loc_b(s) + price_b(s), the first of equals
    base = koff[b]
    best = 0
    best_v = loc[base] + price[base]
    for s in range(1, k[b]):
        v = loc[base + s] + price[base + s]
        if v < best_v:
            best_v = v
            best = s
    return best


@njit(cache=True, nogil=True)
def apply_memory(a, s_old, s_new, term_off, term_lo, term_hi, term_uoff, usage, mx, lz, size):
    for j in range(term_off[a], term_off[a + 1]):
        d = usage[term_uoff[j] + s_new] - usage[term_uoff[j] + s_old]
        if d != 0.0:
            seg_add(mx, lz, size, term_lo[j], term_hi[j], d)


@njit(cache=True, nogil=True)
def run(x, best_x, cur, best, t_start, t_end, iters, seed, tol, compound, lam, lam_step, price,
        k, koff, cost, adj_off, adj_nbr, adj_omoff, omats,
        term_off, term_lo, term_hi, term_uoff, usage, mx, lz, size, max_deg_follow, max_hops_log, max_moved,
        term_node, stab_off, stab_terms, max_repair, repair_prob):
    np.random.seed(seed)
    n = x.shape[0]
    # every node's cost at each of its strategies where its neighbours stand, kept up to date as nodes move
    # (a node's change Δ is then one subtraction, its best response an argmin over k numbers); built
    # afresh for each call, so that rounding does not pile up over more than one chunk
    loc = np.empty(koff[n])
    local_costs(x, k, koff, cost, adj_off, adj_nbr, adj_omoff, omats, loc)
    moved_nodes = np.empty(n + max_repair + 1, np.int64)
    moved_old = np.empty(n + max_repair + 1, np.int64)
    step = (t_end / t_start) ** (1.0 / max(iters, 1))
    temp = t_start
    soft = lam[0] >= 0.0  # lam 0: no penalty on the overflow (memory priced through ``price`` only)
    blocks = lam.shape[0]
    penalised = soft and lam.max() > 0.0  # lam 0 stays 0: no penalty to keep up
    pen_cur = penalty(mx, lz, lam) if penalised else 0.0
    for it in range(iters):
        if it:
            temp *= step
        if penalised and (it & 1023) == 1023:
            # strategic oscillation, per block of rows: overflowing now -> dearer, fitting -> cheaper
            for b in range(blocks):
                if block_max(mx, lz, blocks + b) > tol:
                    lam[b] *= 1.0 + lam_step
                else:
                    lam[b] /= 1.0 + lam_step
            pen_cur = penalty(mx, lz, lam)
        a, t = random_move(x, k)
        if a < 0:
            continue
        s = x[a]
        d = loc[koff[a] + t] - loc[koff[a] + s]
        dp = price[koff[a] + t] - price[koff[a] + s]
        moved_nodes[0] = a
        moved_old[0] = s
        m = 1
        # a's move reaches the memory rows, x and the neighbours' local costs only when something reads
        # them before the move is kept (a compound move, a repair, the soft penalty) or once it is kept: most
        # single moves are undone before anything reads them, and then nothing is done at all
        applied = False
        shifted = False
        if np.random.random() < compound:
            apply_memory(a, s, t, term_off, term_lo, term_hi, term_uoff, usage, mx, lz, size)
            x[a] = t
            shift(a, s, t, k, koff, adj_off, adj_nbr, adj_omoff, omats, loc)
            applied = True
            shifted = True
            # best responses spread outwards from a, hop by hop (up to ``hops``, at most max_moved nodes)
            hops = 1 << np.random.randint(max_hops_log + 1)
            head = 0
            level_end = m
            hop = 0
            while head < m and m < max_moved:
                if head == level_end:
                    hop += 1
                    level_end = m
                    if hop >= hops:
                        break
                c = moved_nodes[head]
                head += 1
                for p in range(adj_off[c], adj_off[c + 1]):
                    b = adj_nbr[p]
                    if adj_off[b + 1] - adj_off[b] > max_deg_follow or m >= max_moved:
                        continue
                    r = best_response(b, k, koff, price, loc)
                    xb = x[b]
                    if r != xb:
                        d += loc[koff[b] + r] - loc[koff[b] + xb]
                        dp += price[koff[b] + r] - price[koff[b] + xb]
                        moved_nodes[m] = b
                        moved_old[m] = xb
                        m += 1
                        apply_memory(b, xb, r, term_off, term_lo, term_hi, term_uoff, usage, mx, lz, size)
                        shift(b, xb, r, k, koff, adj_off, adj_nbr, adj_omoff, omats, loc)
                        x[b] = r
        if not soft or np.random.random() < repair_prob:
            # repair: while a row overflows, a node holding memory on the worst row gives some back, taking
            # of its strategies that use less there the one that adds least cost per byte freed
            if not applied:
                apply_memory(a, s, t, term_off, term_lo, term_hi, term_uoff, usage, mx, lz, size)
                x[a] = t
                applied = True
            for _ in range(max_repair):
                if mx[1] <= tol:
                    break
                if not shifted:
                    shift(a, s, t, k, koff, adj_off, adj_nbr, adj_omoff, omats, loc)
                    shifted = True
                j = covering_term(worst_row(mx, size), size, stab_off, stab_terms)
                if j < 0:
                    break
                b = term_node[j]
                xb = x[b]
                base = koff[b]
                best_u = -1
                best_d = np.inf
                best_score = np.inf
                for u in range(k[b]):
                    freed = usage[term_uoff[j] + xb] - usage[term_uoff[j] + u]
                    if freed > 0.0:
                        du = loc[base + u] - loc[base + xb]
                        if du / freed < best_score:
                            best_score = du / freed
                            best_d = du
                            best_u = u
                if best_u < 0:
                    continue
                d += best_d
                dp += price[base + best_u] - price[base + xb]
                moved_nodes[m] = b
                moved_old[m] = xb
                m += 1
                apply_memory(b, xb, best_u, term_off, term_lo, term_hi, term_uoff, usage, mx, lz, size)
                shift(b, xb, best_u, k, koff, adj_off, adj_nbr, adj_omoff, omats, loc)
                x[b] = best_u
        pen = 0.0
        if soft:
            # soft memory: energy = cost + Σ_blocks lam_b * (the block's largest overflow)+
            if penalised:
                if not applied:
                    apply_memory(a, s, t, term_off, term_lo, term_hi, term_uoff, usage, mx, lz, size)
                    x[a] = t
                    applied = True
                if mx[1] > 0.0 or pen_cur > 0.0:
                    pen = penalty(mx, lz, lam)
            e = d + dp + pen - pen_cur
            ok = e <= 0.0 or np.random.random() < math.exp(-e / temp)
        else:
            ok = mx[1] <= tol  # hard mode always repairs: a's move is applied
            if ok and d + dp > 0.0:
                ok = np.random.random() < math.exp(-(d + dp) / temp)
        if ok:
            if not applied:
                apply_memory(a, s, t, term_off, term_lo, term_hi, term_uoff, usage, mx, lz, size)
                x[a] = t
            if not shifted:
                shift(a, s, t, k, koff, adj_off, adj_nbr, adj_omoff, omats, loc)
            cur += d
            pen_cur = pen
            if mx[1] <= tol and cur < best - 1e-9 * abs(best):
                best = cur
                best_x[:] = x
        elif applied:
            for q in range(m - 1, -1, -1):
                b = moved_nodes[q]
                apply_memory(b, x[b], moved_old[q], term_off, term_lo, term_hi, term_uoff, usage, mx, lz, size)
                if shifted:
                    shift(b, x[b], moved_old[q], k, koff, adj_off, adj_nbr, adj_omoff, omats, loc)
                x[b] = moved_old[q]
    return cur, best  # lam is updated in place


@njit(cache=True, nogil=True)
def block_max(mx, lz, i):
    # the largest value under tree node i: its own mx plus the pending adds of its ancestors
    v = mx[i]
    j = i >> 1
    while j >= 1:
        v += lz[j]
        j >>= 1
    return v


@njit(cache=True, nogil=True)
def penalty(mx, lz, lam):
    # Σ_b lam_b max(0, largest overflow in block b); the blocks are the tree nodes of one depth
    blocks = lam.shape[0]
    p = 0.0
    for b in range(blocks):
        v = block_max(mx, lz, blocks + b)
        if v > 0.0:
            p += lam[b] * v
    return p


@njit(cache=True, nogil=True)
def worst_row(mx, size):
    # the leaf holding the maximum: lz[i] shifts both children of i alike, so follow the larger child
    i = 1
    while i < size:
        i = 2 * i if mx[2 * i] >= mx[2 * i + 1] else 2 * i + 1
    return i - size


@njit(cache=True, nogil=True)
def covering_term(row, size, stab_off, stab_terms):
    # a random memory term live at ``row``: terms are filed under the tree nodes that tile their interval,
    # so the terms live at a row are those filed under the row's leaf and its ancestors
    total = 0
    i = row + size
    while i >= 1:
        total += stab_off[i + 1] - stab_off[i]
        i >>= 1
    if total == 0:
        return -1
    pick = np.random.randint(total)
    i = row + size
    while i >= 1:
        cnt = stab_off[i + 1] - stab_off[i]
        if pick < cnt:
            return stab_terms[stab_off[i] + pick]
        pick -= cnt
        i >>= 1
    return -1


@njit(cache=True, nogil=True)
def random_move(x, k):
    # a random node and a random other strategy of it; (-1, -1) when the node has only one
    a = np.random.randint(x.shape[0])
    if k[a] < 2:
        return -1, -1
    t = np.random.randint(k[a] - 1)
    if t >= x[a]:
        t += 1
    return a, t


@njit(cache=True, nogil=True)
def sample_uphill(x, samples, seed, k, koff, cost, adj_off, adj_nbr, adj_omoff, omats, penalty):
    np.random.seed(seed)
    out = np.empty(samples)
    got = 0
    for _ in range(20 * samples):
        if got >= samples:
            break
        a, t = random_move(x, k)
        if a < 0:
            continue
        d = delta_of(a, t, x, k, koff, cost, adj_off, adj_nbr, adj_omoff, omats)
        if 0.0 < d < penalty:
            out[got] = d
            got += 1
    return out[:got]

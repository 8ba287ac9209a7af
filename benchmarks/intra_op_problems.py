"""Synthetic intra-operator sharding problems for the solver benchmark (``benchmarks/intra_op_ilp.py``).

Three families, all with ~10 strategies per node on a notional 8-device 2-D mesh and memory limits set
relative to the tightest feasible one (``max_t Σ_{i live at t} min_s mem_i(s)``):

* ``random``: a random DAG; each op reads 1-3 earlier values, mostly recent ones, sometimes far back.
* ``layered``: layers of equal width; each op reads two ops of the previous layer and, now and then, one
  of a layer far back (a long skip).
* ``transformer``: a train step of pre-LN transformer blocks: forward ops, parameters live for the
  whole step, activations live from the forward op to its backward consumer (long skip edges), backward
  ops, and optimizer ops tied to their parameter. Elementwise ops must follow their operand (+inf
  off-diagonal edges), as an upstream planner would emit; parameters must keep their sharding across
  the step (parameter in/out tied by +inf edges).

Costs come from one resharding template per problem (``bytes × T[a, b]``) and a roofline-like compute
cost (``flops / degree``), so that costs are correlated the way real ones are.
"""

from __future__ import annotations

import numpy as np

from solvers import IntraOpProblem

K = 10
DEGREE = np.array([1, 2, 2, 4, 4, 8, 8, 2, 4, 8], dtype=np.float64)


class _Builder:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        rng = self.rng
        t = rng.uniform(0.2, 1.0, (K, K)) * (1.0 - 1.0 / DEGREE[:, None]) + rng.uniform(0.0, 0.3, (K, K)) / DEGREE[None, :]
        np.fill_diagonal(t, 0.0)
        self.template = t
        self.allreduce = np.where(rng.random(K) < 0.4, rng.uniform(0.5, 1.5, K), 0.0)
        self.costs: list[np.ndarray] = []
        self.memory: list[np.ndarray] = []
        self.start: list[int] = []
        self.end: list[int] = []
        self.names: list[str] = []
        self.edges: list[tuple[int, int]] = []
        self.edge_costs: list[np.ndarray] = []

    def node(self, name: str, flops: float, nbytes: float, t: int, k: int = K) -> int:
        rng = self.rng
        d = DEGREE[:k]
        comm = nbytes * self.allreduce[:k] * (1 - 1 / d)
        self.costs.append(flops / d * rng.uniform(0.9, 1.1, k) + comm)
        self.memory.append(nbytes / d)
        self.start.append(t)
        self.end.append(t + 1)
        self.names.append(name)
        return len(self.costs) - 1

    def use(self, u: int, v: int, t: int, *, follow: bool = False) -> None:
        """``v`` (at time ``t``) reads ``u``: an edge, and ``u`` stays live until ``t``."""
        self.end[u] = max(self.end[u], t + 1)
        ku, kv = self.costs[u].shape[0], self.costs[v].shape[0]
        nbytes = self.memory[u][0]
        if follow and ku == kv:
            m = np.full((ku, kv), np.inf)
            np.fill_diagonal(m, 0.0)
        else:
            m = nbytes * self.template[:ku, :kv] * self.rng.uniform(0.8, 1.2)
        self.edges.append((u, v))
        self.edge_costs.append(m)

    def problem(self, limit_factor: float | None) -> IntraOpProblem:
        p = IntraOpProblem(
            node_costs=self.costs,
            node_memory=self.memory,
            intervals=np.stack([self.start, self.end], 1),
            edges=np.array(self.edges, dtype=np.int64),
            edge_costs=self.edge_costs,
            node_names=self.names,
        )
        if limit_factor is None:
            return p
        _, low = p.usage_at_points(p.min_memory())
        return IntraOpProblem(
            node_costs=p.node_costs, node_memory=p.node_memory, intervals=p.intervals, edges=p.edges,
            edge_costs=p.edge_costs, node_names=p.node_names, memory_limit=float(low.max()) * limit_factor,
        )


def random_problem(n: int, *, seed: int = 0, limit_factor: float | None = 1.05) -> IntraOpProblem:
    b = _Builder(seed)
    rng = b.rng
    for i in range(n):
        v = b.node(f"op{i}", rng.uniform(1, 10), rng.uniform(0.1, 4), i)
        if i == 0:
            continue
        for j in range(int(rng.integers(1, 4)) if i > 3 else 1):
            if rng.random() < 0.05:
                u = int(rng.integers(0, i))
            else:
                u = max(0, i - 1 - int(rng.geometric(0.4)) + 1)
            b.use(u, v, i, follow=(j == 0 and rng.random() < 0.35))
    return b.problem(limit_factor)


def layered_problem(n: int, *, width: int = 20, seed: int = 0, limit_factor: float | None = 1.05) -> IntraOpProblem:
    b = _Builder(seed)
    rng = b.rng
    layers: list[list[int]] = []
    t = 0
    while sum(len(x) for x in layers) < n:
        layer = []
        for w in range(min(width, n - sum(len(x) for x in layers))):
            v = b.node(f"L{len(layers)}.{w}", rng.uniform(1, 10), rng.uniform(0.1, 4), t)
            layer.append(v)
            if layers:
                prev = layers[-1]
                for j, u in enumerate(rng.choice(prev, size=min(2, len(prev)), replace=False).tolist()):
                    b.use(u, v, t, follow=(j == 0 and rng.random() < 0.3))
                if len(layers) > 8 and rng.random() < 0.05:
                    b.use(int(rng.choice(layers[-int(rng.integers(4, 9))])), v, t)
        layers.append(layer)
        t += 1
    return b.problem(limit_factor)


def transformer_problem(n: int, *, seed: int = 0, limit_factor: float | None = 1.05) -> IntraOpProblem:
    """About 60 nodes per block; ``n // 60`` blocks."""
    b = _Builder(seed)
    rng = b.rng
    blocks = max(1, n // 60)
    hidden, act = 4.0, 2.0  # bytes of a weight and of an activation (arbitrary units)
    t = 0
    params: list[int] = []
    saved: list[tuple[int, int]] = []  # (activation, param or -1) in forward order
    x = b.node("embed", 5.0, act, t)
    for blk in range(blocks):
        def op(name: str, flops: float, nbytes: float, *ins: int, follow: bool = False, k: int = K,
               blk: int = blk) -> int:
            nonlocal t
            t += 1
            v = b.node(f"block{blk}.{name}", flops * rng.uniform(0.9, 1.1), nbytes, t, k)
            for j, u in enumerate(ins):
                b.use(u, v, t, follow=follow and j == 0)
            return v

        def param(name: str, nbytes: float, blk: int = blk) -> int:
            v = b.node(f"block{blk}.{name}", 0.0, nbytes, 0)
            params.append(v)
            return v

        res = x
        ln1 = op("ln1", 1.0, act, x, follow=True)
        wq, wk, wv, wo = (param(f"w{c}", hidden) for c in "qkvo")
        q, k_, v = (op(f"{c}_proj", 8.0, act, ln1, w) for c, w in zip("qkv", (wq, wk, wv), strict=True))
        scores = op("scores", 6.0, act * 2, q, k_)
        probs = op("softmax", 1.0, act * 2, scores, follow=True)
        ctx = op("context", 6.0, act, probs, v)
        out = op("out_proj", 8.0, act, ctx, wo)
        x1 = op("residual1", 0.5, act, out, res, follow=True)
        ln2 = op("ln2", 1.0, act, x1, follow=True)
        w1, w2 = param("w_up", hidden * 4), param("w_down", hidden * 4)
        up = op("mlp_up", 32.0, act * 4, ln2, w1)
        gelu = op("gelu", 2.0, act * 4, up, follow=True)
        down = op("mlp_down", 32.0, act, gelu, w2)
        x = op("residual2", 0.5, act, down, x1, follow=True)
        saved += [(ln1, wq), (ln1, wk), (ln1, wv), (scores, -1), (probs, -1), (ctx, wo), (x1, -1),
                  (ln2, w1), (gelu, w2), (up, -1)]
    loss = b.node("loss", 2.0, act, t + 1)
    b.use(x, loss, t + 1)
    t += 1
    g = loss
    # backward: walk the saved activations in reverse; each makes a grad op reading the running grad
    # and its forward activation (a long skip edge), and a weight-grad op reading the parameter
    for i, (a, w) in enumerate(reversed(saved)):
        t += 1
        gx = b.node(f"bwd{i}.dx", 8.0 * rng.uniform(0.5, 1.5), act, t)
        b.use(g, gx, t)
        b.use(a, gx, t)
        if w >= 0:
            t += 1
            dw = b.node(f"bwd{i}.dw", 8.0 * rng.uniform(0.5, 1.5), b.memory[w][0], t)
            b.use(gx, dw, t)
            b.use(a, dw, t)
            b.use(w, dw, t)
            saved[len(saved) - 1 - i] = (dw, w)
        if rng.random() < 0.3:
            t += 1
            gx2 = b.node(f"bwd{i}.dx_elementwise", 1.0, act, t)
            b.use(gx, gx2, t, follow=True)
            gx = gx2
        g = gx
    # optimizer: per parameter, Adam moments and the update must keep the parameter's sharding
    for dw, w in saved:
        if dw == w or b.names[dw].startswith("block"):
            continue
        t += 1
        m1 = b.node(f"{b.names[w]}.adam_m", 1.0, b.memory[w][0], t)
        b.use(dw, m1, t)
        b.use(w, m1, t, follow=True)
        m2 = b.node(f"{b.names[w]}.adam_v", 1.0, b.memory[w][0], t)
        b.use(dw, m2, t)
        b.use(m1, m2, t, follow=True)
        upd = b.node(f"{b.names[w]}.update", 1.0, b.memory[w][0], t)
        b.use(m2, upd, t, follow=True)
        b.use(w, upd, t, follow=True)
        b.start[m1] = b.start[m2] = 0  # optimizer state lives for the whole step
    for w in params:
        b.end[w] = t + 1
    return b.problem(limit_factor)


FAMILIES = {"random": random_problem, "layered": layered_problem, "transformer": transformer_problem}

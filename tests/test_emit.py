"""Emission: a traced step re-emitted under jax.jit with sharding constraints matches the unsharded step.

Numerics are measured as one global relative norm over all leaves (DESIGN.md): losses and Adam moments
(mu/nu) over 3 steps, against ``jax.jit(train_step)`` on one device, bar 1e-5. Structure is checked on the
programs: collectives in ``compiled.as_text()``, constraints inside scan bodies in ``lowered.as_text()``,
donation as ``tf.aliasing_output`` and as deleted input buffers.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard._examples import load_module
from autoshard.emit import EmitError, EmittedStep, SpecMap, emit, global_rel_error, iter_scopes, scope_key
from autoshard.trace import Graph, Role
from cost_models.spec import ShardingSpec

TOL = 1e-5
STEPS = 3


def _mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def S(*dims: str | tuple[str, ...] | None) -> ShardingSpec:
    """``S("data", None)`` = split dim 0 over data, replicate dim 1."""
    return ShardingSpec(tuple(() if d is None else (d,) if isinstance(d, str) else d for d in dims))


# ---- examples, built once per test session --------------------------------------------------------------


@functools.cache
def _example(path: str, **overrides: Any) -> tuple[Callable[..., Any], Graph, tuple[Any, ...]]:
    mod = load_module(path)
    args = jax.jit(lambda: mod.make("tiny", **overrides))()  # one compiled init: faster than eager
    return mod.train_step, autoshard.trace(mod.train_step, *args), args


def _moments(state: Any) -> list[Any]:
    """The optimizer's moments: Adam's mu and nu, or SGD's momentum ``trace`` (Wide-ResNet)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state.opt_state)
    out = [x for p, x in flat if any(getattr(k, "name", None) in ("mu", "nu", "trace") for k in p)]
    assert out, "no optimizer moments found"
    return out


@functools.cache
def _reference(path: str, **overrides: Any) -> list[tuple[float, list[np.ndarray]]]:
    step, _, args = _example(path, **overrides)
    ref = jax.jit(step)
    state, batch = args
    out = []
    for _ in range(STEPS):
        state, metrics = ref(state, batch)
        out.append((float(metrics["loss"]), [np.asarray(m) for m in _moments(state)]))
    return out


def _check_numerics(path: str, specs: SpecMap, **overrides: Any) -> EmittedStep:
    """Run the emitted step 3 times against the reference; assert the worst loss and moment relative
    errors are under 1e-5; return the emitted step (for looking at its programs)."""
    _, graph, args = _example(path, **overrides)
    fn = emit(graph, specs, _mesh())
    state, batch = fn.place(*args)
    loss_err = mom_err = 0.0
    for want_loss, want_mom in _reference(path, **overrides):
        state, metrics = fn(state, batch)
        loss_err = max(loss_err, abs(float(metrics["loss"]) - want_loss) / abs(want_loss))
        mom_err = max(mom_err, global_rel_error(want_mom, _moments(state)))
    print(f"{path} {overrides}: loss rel err {loss_err:.2e}, moments global rel err {mom_err:.2e}")
    assert loss_err < TOL and mom_err < TOL, (path, overrides, loss_err, mom_err)
    return fn


def _data_parallel(graph: Graph, axes: tuple[str, ...] = ("data", "model")) -> SpecMap:
    return {(): {t.id: S(axes, *[None] * (len(t.shape) - 1)) for t in graph.input_tensors(Role.BATCH)}}


def _by_suffix(graph: Graph, table: dict[str, ShardingSpec], specs: dict[int, ShardingSpec]) -> int:
    """Give every param / mu / nu input whose name ends with a key of ``table`` that spec."""
    n = 0
    for t in graph.input_tensors():
        for suffix, spec in table.items():
            if t.name.endswith(suffix):
                specs[t.id] = spec
                n += 1
    return n


# ---- data parallel and Megatron on the MLP ---------------------------------------------------------------


def test_mlp_data_parallel_numerics_collectives_and_donation() -> None:
    _, graph, args = _example("examples/mlp.py")
    specs = _data_parallel(graph)
    fn = _check_numerics("examples/mlp.py", specs)
    placed = fn.place(*args)
    lowered = fn.lowered(*placed)
    assert "all-reduce" in lowered.compile().as_text()  # the gradient all-reduce
    aliased = re.findall(r"tf\.aliasing_output = (\d+)", lowered.as_text())
    assert len(aliased) == len(graph.output_aliases) == len(fn.donate_argnums) > 0
    assert not any(n.startswith("batch") for n in fn.donated_inputs())
    fn(*placed)
    leaves = jax.tree_util.tree_leaves(placed)
    assert all(leaves[i].is_deleted() for i in fn.donate_argnums)
    assert not any(x.is_deleted() for i, x in enumerate(leaves) if i not in fn.donate_argnums)


def test_mlp_megatron_pair() -> None:
    _, graph, _ = _example("examples/mlp.py")
    top = dict(_data_parallel(graph, ("data",))[()])
    n = _by_suffix(graph, {
        "dense_0.kernel": S(None, "model"),  # column parallel
        "dense_0.bias": S("model"),
        "dense_1.kernel": S("model", None),  # row parallel
    }, top)
    assert n == 9  # params, mu, nu
    # the hidden activation between the pair: batch over data, features over model
    for op in graph.ops:
        t = graph.tensors[op.outputs[0]]
        if op.primitive == "dot_general" and op.phase == "forward" and t.shape == (16, 64):
            top[t.id] = S("data", "model")
            break
    else:
        raise AssertionError("no forward hidden activation found")
    fn = _check_numerics("examples/mlp.py", {(): top})
    assert sum("model" in str(s.spec) for s in fn.in_shardings) == n


# ---- GPT: Megatron blocks, and constraints inside the scan body -------------------------------------------

_GPT_MEGATRON = {
    "attn.qkv.kernel": S(None, "model"),
    "attn.qkv.bias": S("model"),
    "attn.proj.kernel": S("model", None),
    "mlp.fc.kernel": S(None, "model"),
    "mlp.fc.bias": S("model"),
    "mlp.proj.kernel": S("model", None),
}


@pytest.mark.slow
def test_gpt_megatron() -> None:
    _, graph, _ = _example("examples/gpt.py")
    top = dict(_data_parallel(graph, ("data",))[()])
    assert _by_suffix(graph, _GPT_MEGATRON, top) == 3 * 2 * len(_GPT_MEGATRON)  # 2 layers × (param, mu, nu)
    _check_numerics("examples/gpt.py", {(): top})


def _activation(shape: tuple[int, ...]) -> ShardingSpec | None:
    """Batch over data (rank ≥ 3), last dimension over model, where they divide."""
    dims: list[tuple[str, ...]] = [()] * len(shape)
    if len(shape) >= 3 and shape[0] % 2 == 0:
        dims[0] = ("data",)
    if shape and shape[-1] % 4 == 0:
        dims[-1] = ("model",)
    return ShardingSpec(tuple(dims)) if any(dims) else None


def _pin_body_matmuls(graph: Graph) -> SpecMap:
    specs: SpecMap = {}
    for key, g in iter_scopes(graph):
        if not key:
            continue
        for op in g.ops:
            if op.primitive == "dot_general":
                spec = _activation(g.tensors[op.outputs[0]].shape)
                if spec is not None:
                    specs.setdefault(key, {})[op.outputs[0]] = spec
    return specs


def test_gpt_scan_body_constraints() -> None:
    _, graph, args = _example("examples/gpt.py", scan_layers=True)
    specs = _pin_body_matmuls(graph)
    scans = [op for op in graph.ops if op.primitive == "scan"]
    assert len(scans) == 2 and all(scope_key((op.id, 0)) in specs for op in scans)
    top = dict(_data_parallel(graph, ("data",))[()])
    _by_suffix(graph, {k: S(None, *v.dims) for k, v in _GPT_MEGATRON.items()}, top)  # leading layer axis
    specs[()] = top
    fn = _check_numerics("examples/gpt.py", specs, scan_layers=True)
    text = fn.lowered(*fn.place(*args)).as_text()
    n_body = sum(len(v) for k, v in specs.items() if k)
    placed = {k: n for k, n in fn.interpreter.constraints.items() if k}
    assert placed == {k: len(v) for k, v in specs.items() if k}
    assert set(fn.interpreter.rebuilt) == {scope_key((op.id, 0)) for op in scans}
    assert text.count("stablehlo.while") == 2
    assert _constraints_in_loop_bodies(text) == n_body


def _constraints_in_loop_bodies(text: str) -> int:
    """``sdy.sharding_constraint``s inside the ``do`` regions of the program's outermost while loops, and in
    the functions those regions call: jax 0.10 lowers a scan body to a private ``@closed_call`` function,
    jax 0.11 inlines it into the region."""
    funcs = dict(re.findall(r"func\.func \w+ @([\w.$-]+)(.*?)(?=\n  func\.func |\Z)", text, flags=re.S))

    def count(body: str, seen: frozenset[str]) -> int:
        calls = re.findall(r"func\.call @([\w.$-]+)", body)
        return body.count("sdy.sharding_constraint") + sum(count(funcs[c], seen | {c}) for c in calls
                                                            if c in funcs and c not in seen)

    total, end = 0, 0
    for m in re.finditer(r"\} do \{", text):
        if m.start() < end:
            continue  # a loop nested in a region already counted
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        end = i
        total += count(text[m.end():i], frozenset())
    return total


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [True, False])
def test_gpt_remat_body_constraints(scan_layers: bool) -> None:
    _, graph, _ = _example("examples/gpt.py", scan_layers=scan_layers, remat=True)
    specs = _pin_body_matmuls(graph)
    depth = 2 if scan_layers else 1  # the remat inside the scan, or the remats at the top level
    assert any(len(k) == depth for k in specs)
    fn = _check_numerics("examples/gpt.py", specs, scan_layers=scan_layers, remat=True)
    assert any(p.startswith("remat") or p == "checkpoint" for p in fn.interpreter.rebuilt.values())


@pytest.mark.slow
@pytest.mark.parametrize("path", ["examples/moe.py", "examples/wide_resnet.py", "examples/gpt.py"])
def test_data_parallel_examples(path: str) -> None:
    _, graph, _ = _example(path)
    axes = ("data", "model")
    if any(t.shape[0] % 8 for t in graph.input_tensors(Role.BATCH)):
        axes = ("data",)
    _check_numerics(path, _data_parallel(graph, axes))


# ---- control flow: cond, while, scan with closed-over constants, custom_jvp --------------------------------


_TABLE = np.linspace(0.0, 1.0, 8, dtype=np.float32)


@jax.jit
def _shift(h: jax.Array) -> jax.Array:
    """A nested jit closing over a NumPy constant: the tracer inlines it, and its constant lands in
    whichever body calls it, so rebuilding that body must turn the constant into an operand."""
    return h + _TABLE


def _cf_step(w: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    def loss(w: jax.Array) -> jax.Array:
        def body(h: jax.Array, s: jax.Array) -> tuple[jax.Array, jax.Array]:
            h = jax.nn.relu(_shift(h @ w) * s)  # relu is a custom_jvp (inlined by the tracer)
            return h, jnp.sum(h, axis=1)

        h, ys = jax.lax.scan(body, x, jnp.arange(1, 4, dtype=jnp.float32) / 3)
        h = jax.lax.cond(jnp.sum(h) > 0, lambda h: _shift(h) * 2.0, lambda h: h @ w.T, h)
        return jnp.mean(h**2) + jnp.mean(ys)

    val, g = jax.value_and_grad(loss)(w)
    n = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(_shift(c[1] @ w))), (0, x))[1]
    m = jax.lax.scan(lambda c, _: (_shift(c) * 0.5, None), x, None, length=2)[0]
    return val + jnp.mean(n) + jnp.mean(m), g


def _pin_batch_rows(graph: Graph) -> SpecMap:
    """Pin every [16, 8] value: op outputs everywhere, and body inputs (scan/while carries)."""
    specs: SpecMap = {}
    for key, g in iter_scopes(graph):
        tids = [t for op in g.ops for t in op.outputs] + (list(g.inputs) if key else [])
        for tid in tids:
            if g.tensors[tid].shape == (16, 8):
                specs.setdefault(key, {})[tid] = S("data", "model") if key else S("data", None)
    return specs


def test_control_flow_bodies_rebuilt_with_constants() -> None:
    w = jax.random.normal(jax.random.key(0), (8, 8), jnp.float32) / 3
    x = jax.random.normal(jax.random.key(1), (16, 8), jnp.float32)
    graph = autoshard.trace(_cf_step, w, x)
    prims = {op.primitive for _, op in graph.walk()}
    assert {"scan", "cond", "while"} <= prims and "custom_jvp_call" not in prims
    specs = _pin_batch_rows(graph)
    kinds = {graph.ops[k[0][0]].primitive for k in specs if k}
    assert {"scan", "cond", "while"} <= kinds
    specs[()][graph.inputs[1]] = S("data", None)
    specs[()][graph.outputs[1]] = ShardingSpec(((), ()), partial=frozenset({"model"}))  # partial is ignored
    fn = emit(graph, specs, _mesh())
    want = jax.jit(_cf_step)(w, x)
    got = fn(w, x)
    assert global_rel_error(want, got) < TOL
    placed = {k: n for k, n in fn.interpreter.constraints.items() if k}
    assert placed == {k: len(v) for k, v in specs.items() if k}
    hoisted = {graph.ops[k[0][0]].primitive for k, n in fn.interpreter.hoisted.items() if n}
    assert {"scan", "cond", "while"} <= hoisted  # the bodies' inlined constant became an operand
    assert fn.donate_argnums == ()
    assert fn.out_shardings[1].spec == jax.sharding.PartitionSpec(None, None)


def test_primitive_with_unrecognised_subjaxprs_is_bound_as_traced() -> None:
    def solve(a: jax.Array, b: jax.Array) -> jax.Array:
        x = jax.lax.custom_linear_solve(lambda x: a @ x, b, solve=lambda mv, b: b / jnp.diag(a), symmetric=True)
        return x * 2.0

    a, b = jnp.eye(8, dtype=jnp.float32) * 2.0, jnp.arange(8, dtype=jnp.float32)
    graph = autoshard.trace(solve, a, b)
    assert graph.ops[0].primitive == "custom_linear_solve"
    fn = emit(graph, {(): {graph.inputs[1]: S("model")}}, _mesh())
    assert global_rel_error(solve(a, b), fn(a, b)) < TOL


def test_no_specs_matches_and_replicates() -> None:
    w = jnp.ones((8, 8), jnp.float32) / 8
    x = jnp.arange(128, dtype=jnp.float32).reshape(16, 8) / 128
    graph = autoshard.trace(_cf_step, w, x)
    fn = emit(graph, None, _mesh())
    assert global_rel_error(jax.jit(_cf_step)(w, x), fn(w, x)) < TOL
    assert all(s.spec == jax.sharding.PartitionSpec() for s in fn.in_shardings)


def test_one_device_mesh_places_no_constraints() -> None:
    # every layout on one device is the whole array: the program is jax.jit's, with nothing pinned
    w = jax.random.normal(jax.random.key(0), (8, 8), jnp.float32) / 3
    x = jax.random.normal(jax.random.key(1), (16, 8), jnp.float32)
    graph = autoshard.trace(_cf_step, w, x)
    specs = _pin_batch_rows(graph)
    one = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    fn = emit(graph, specs, one)
    assert global_rel_error(jax.jit(_cf_step)(w, x), fn(w, x)) < TOL
    assert fn.interpreter.constraints == {}
    assert "sharding_constraint" not in fn.lowered(w, x).as_text()
    assert len(emit(graph, specs, _mesh()).lowered(w, x).as_text().split("sharding_constraint")) > 1


# ---- validation ---------------------------------------------------------------------------------------------


def _small(a: jax.Array) -> jax.Array:
    return jnp.sin(a) @ a.T


def _small_graph() -> Graph:
    return autoshard.trace(_small, jnp.ones((6, 8), jnp.float32))


@pytest.mark.parametrize(
    ("spec", "expect"),
    [
        (S(None, "nope"), r"'nope', not an axis of the mesh"),
        (S("data"), r"spec S\(data\) has 1 dimensions but the tensor has 2"),
        (S("model", None), r"dimension 0 of size 6 does not divide into the 4 shards of model"),
        (S(None, ("data", "model")), None),  # 8 divides into 2×4: fine
    ],
)
def test_validation_names_tensor_and_fix(spec: ShardingSpec, expect: str | None) -> None:
    graph = _small_graph()
    specs: SpecMap = {(): {graph.inputs[0]: spec}}
    if expect is None:
        emit(graph, specs, _mesh())
        return
    with pytest.raises(EmitError, match=expect) as err:
        emit(graph, specs, _mesh())
    assert "'a' float32[6, 8] (input 0 of the graph)" in str(err.value)


def test_validation_of_op_outputs_names_source_line() -> None:
    graph = _small_graph()
    op = next(op for op in graph.ops if op.primitive == "sin")
    with pytest.raises(EmitError, match=r"made by sin \(op \d+\).* at .*test_emit\.py:\d+.*size 6"):
        emit(graph, {(): {op.outputs[0]: S(("data", "model"), None)}}, _mesh())


def test_validation_of_scopes_and_ids() -> None:
    graph = _small_graph()
    with pytest.raises(EmitError, match=r"\(op 0\).* has 0 bodies"):
        emit(graph, {scope_key((0, 0)): {}}, _mesh())
    with pytest.raises(EmitError, match=r"op 100000 does not exist"):
        emit(graph, {scope_key(100000, 0): {}}, _mesh())
    with pytest.raises(EmitError, match=r"tensor id 10000000 is not a tensor of the top-level graph"):
        emit(graph, {(): {10_000_000: S()}}, _mesh())
    with pytest.raises(EmitError, match=r"expected cost_models\.ShardingSpec"):
        emit(graph, {(): {0: jax.sharding.PartitionSpec()}}, _mesh())  # type: ignore[dict-item]
    assert scope_key(3, 0, 5, 1) == scope_key((3, 0), (5, 1)) == ((3, 0), (5, 1))


def test_validation_rejects_explicit_axes() -> None:
    explicit = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with pytest.raises(EmitError, match="not Auto"):
        emit(_small_graph(), {}, explicit)


def test_wrong_argument_structure() -> None:
    _, graph, (state, batch) = _example("examples/mlp.py")
    fn = emit(graph, {}, _mesh())
    with pytest.raises(EmitError, match="pytree structure differs"):
        fn(state, {"x": batch["x"]})

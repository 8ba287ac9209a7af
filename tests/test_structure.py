"""The model's repeated blocks found from its graph, whatever its layers are called (``trace.structure``)."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

from autoshard.pipeline.partition import PipelineDoesNotFit
from autoshard.pipeline.recompute import plan_pipeline_recomputing
from autoshard.trace import trace
from autoshard.trace.remat import blocks, rematerialize, uniform
from autoshard.trace.structure import structure
from autoshard.trace.unroll import unroll_layer_stacks

sys.path.insert(0, str(Path(__file__).parent))
import style_models

ROOT = Path(__file__).resolve().parents[1]


def _graph(model: object, **overrides: object):
    state, batch = model.make("tiny", abstract=True, **overrides)
    return unroll_layer_stacks(trace(model.train_step, state, batch))


def _per_block(graph) -> list[tuple[int, int]]:
    """Per block in forward order: (its forward ops, its backward ops)."""
    count = collections.Counter((op.layer, op.phase) for op in graph.ops if op.layer)
    return [(count[(tag, "forward")], count[(tag, "backward")]) for tag in structure(graph).tags]


def _signatures(graph) -> list[list[tuple[str, tuple]]]:
    """Per block, its forward ops' primitives and operand shapes in order."""
    out = []
    for run in structure(graph).runs:
        for block in run.blocks:
            out.append([(graph.ops[i].primitive, tuple(graph.tensors[t].shape for t in graph.ops[i].inputs))
                        for i in block])
    return out


@pytest.mark.parametrize("style", [s for s in style_models.STYLES if s != "example"])
def test_every_style_of_writing_the_gpt_gives_the_examples_blocks(style: str) -> None:
    """``block_i``, ``h/0``, ``Block_i``, an nnx list (no names at all), ``nn.scan`` (unrolled) and ordinal
    names: the same blocks, each the example's computation, and each block's backward the same size."""
    want = _graph(style_models.STYLES["example"], layers=4)
    got = _graph(style_models.STYLES[style], layers=4)
    (run,) = structure(got).runs
    assert len(run.blocks) == 4
    work = [sum(want.ops[i].flops for i in b) for b in structure(want).runs[0].blocks]
    got_work = [sum(got.ops[i].flops for i in b) for b in run.blocks]
    if style == "scan":  # the body's ops made again per block, less the causal mask JAX hoists out of the
        # scan (made once before the blocks): the same work per block, 0.25% less of it
        assert len(set(_per_block(got))) == 1 and len(set(got_work)) == 1
        assert 0.99 * work[0] < got_work[0] <= work[0]
    else:
        assert got_work == pytest.approx(work)
        assert _per_block(got) == _per_block(want)
    if style not in ("scan", "nnx_list"):  # linen's modules: the very same ops (nnx's LayerNorm reshapes)
        assert _signatures(got) == _signatures(want)
    assert len(set(run.tags)) == 4


def test_layer_norms_named_like_blocks_are_not_blocks() -> None:
    """GPT-2 as Hugging Face names it (``h/0/ln_1``, ``h/0/ln_2``): 4 blocks, not 8 layer norms; each block's
    backward holds its transposed ``Conv1D`` weight gradients, found from the dataflow."""
    graph = _graph(style_models.OTHERS["gpt2"])
    (run,) = structure(graph).runs
    assert len(run.blocks) == 4 and all(t.endswith(f"h/{k}") for k, t in enumerate(run.tags))
    assert len(set(_per_block(graph))) == 1
    # every weight gradient (a dot_general whose result has a kernel's shape) runs in its block's backward
    kernels = {graph.tensors[t].shape for t in graph.inputs if "c_attn" in graph.tensors[t].name
               and graph.tensors[t].name.endswith("kernel") and "params" in graph.tensors[t].name}
    grads = [op for op in graph.ops if op.phase == "backward" and op.primitive == "dot_general"
             and graph.tensors[op.outputs[0]].shape in kernels]
    assert len(grads) == 4 and sorted(op.layer for op in grads) == sorted(run.tags)


def test_an_encoder_and_a_decoder_are_two_runs_and_both_recompute() -> None:
    graph = _graph(style_models.OTHERS["encoder_decoder"])
    s = structure(graph)
    assert [len(r.blocks) for r in s.runs] == [2, 2] and s.runs[0].period != s.runs[1].period
    # the decoder's blocks read the encoder's output alike (after its final norm): a side input of the run,
    # made between the two runs
    (memory,) = [graph.tensors[t] for t in s.runs[1].side_inputs if graph.tensors[t].dtype == "float32"]
    assert s.runs[0].blocks[-1][-1] < memory.producer < s.runs[1].blocks[0][0]
    names = blocks(graph)
    assert len(names) == 4
    full = rematerialize(graph, uniform(graph, "full"))
    full.verify()
    replayed = {op.layer for op in full.ops if op.phase == "backward" and op.primitive == "optimization_barrier"}
    assert replayed == set(names)


def test_alternating_dense_and_expert_layers_are_a_unit_of_two() -> None:
    graph = _graph(style_models.OTHERS["alternating"])
    (run,) = structure(graph).runs
    assert len(run.blocks) == 2
    for block in run.blocks:  # each unit: one dense block and one expert block
        scopes = {graph.ops[i].scope.split("/")[2] for i in block if graph.ops[i].scope.count("/") >= 2}
        assert len({s for s in scopes if s.startswith("block_")}) == 2


def test_llama_blocks_read_the_mask_and_rope_tables_as_side_inputs() -> None:
    from autoshard._examples import load_module

    llama = load_module(ROOT / "examples" / "llama.py")
    graph = _graph(llama)
    (run,) = structure(graph).runs
    assert len(run.blocks) == 4 and run.tags[0].endswith("layers/0")
    side = [graph.tensors[t] for t in run.side_inputs]
    assert any(t.dtype in ("bool", "int32", "float32") and t.producer is not None for t in side)
    assert len(side) >= 3  # the mask (from the batch) and the cos and sin tables


def test_a_model_with_no_repeated_layers_has_no_blocks() -> None:
    from autoshard._examples import load_module

    mlp = load_module(ROOT / "examples" / "mlp.py")
    state, batch = mlp.make("tiny", abstract=True)
    graph = trace(mlp.train_step, state, batch)
    assert structure(graph).runs == () and not any(op.layer for op in graph.ops)


def test_a_pipeline_that_needs_recompute_without_blocks_says_what_was_tried() -> None:
    """No mode fits and there is nothing to recompute: a clear error, not an assertion."""
    from autoshard._examples import load_module

    mlp = load_module(ROOT / "examples" / "mlp.py")
    state, batch = mlp.make("tiny", abstract=True)
    graph = trace(mlp.train_step, state, batch)

    def plan(g, seconds, modes):
        raise PipelineDoesNotFit("no cut fits")

    with pytest.raises(PipelineDoesNotFit, match=r"no repeated blocks to recompute.*larger memory budget"):
        plan_pipeline_recomputing(graph, plan, start="full", hopeless=lambda m: True)


def test_two_stacks_are_refused_by_the_spmd_program_with_what_to_do() -> None:
    from autoshard.pipeline.partition import PipelineError
    from autoshard.pipeline.uniform import uniform_stages

    graph = _graph(style_models.OTHERS["encoder_decoder"])
    with pytest.raises(PipelineError, match=r"2 kinds .*encoder and a decoder.*runtime='mpmd'"):
        uniform_stages(graph, 2)

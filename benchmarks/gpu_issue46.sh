#!/usr/bin/env bash
# Issue #46's GPU items in one call of the device machine (one H200; about 6 minutes, each part stopping at
# its deadline; rows written as they complete). Needs `.whl` (pulp, highspy for Python 3.12) and `.plans`
# (the plan cache, made here with jax 0.11.2: see benchmarks/README.md) carried. Usage there:
#
#     bash benchmarks/gpu_issue46.sh $OUT
#
# Two processes at once: (A) the sharded programs compiled for 8 mocked GPUs (compile only: no
# preallocation, no autotuning, so it leaves the GPU to B) and (B) the timed one-GPU parts, one after the
# other: attention kernels, the flash step, then scanned stacks, the dispatch cost and a stage's tick.
set -u
OUT=${1:?usage: gpu_issue46.sh OUTDIR}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
{
    date -u; python3 -V; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__)"
} > "$OUT/env.txt" 2>&1
T0=$(date +%s)

(XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0 \
    python3 benchmarks/gpu_truth_sharded.py --parts probe mock --models 350m --hardware h200 \
    --plans .plans/sharded.json --time-budget 5 --deadline "${A_DEADLINE:-330}" --out "$OUT/sharded.jsonl" \
    > "$OUT/mock.log" 2>&1) &
A=$!

export XLA_PYTHON_CLIENT_MEM_FRACTION=.80
{
    python3 benchmarks/gpu_attention.py --out "$OUT/attention.jsonl" --deadline "${ATT_DEADLINE:-100}"
    echo "attention done at $(( $(date +%s) - T0 )) s"
    python3 benchmarks/gpu_longseq.py --rows flash --out "$OUT/longseq.jsonl" --deadline 80 --row-seconds 10
    echo "longseq done at $(( $(date +%s) - T0 )) s"
    python3 benchmarks/gpu_truth_sharded.py --parts one-device --hardware h200 --plans .plans/sharded.json \
        --time-budget 5 --deadline "${ONE_DEADLINE:-170}" --out "$OUT/onedev.jsonl"
    echo "one-device done at $(( $(date +%s) - T0 )) s"
} > "$OUT/timed.log" 2>&1
wait $A
echo "all done at $(( $(date +%s) - T0 )) s" >> "$OUT/timed.log"
tail -n 4 "$OUT/timed.log" "$OUT/mock.log"

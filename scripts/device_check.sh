#!/usr/bin/env bash
# The prepared run for a lent GPU machine (docs/cuda.md, "Measured on an H200"): nothing can be
# downloaded there, so the fla-core wheel travels in .whl (pip download --no-deps fla-core==0.6.0
# -d .whl here) and hybridrt is put on the path as a symlinked package tree. Writes under $OUT:
# gpu.txt (versions), tests.log (tests/gpu/test_attention.py and test_cuda_backend.py on the GPU:
# the attention kernels, the CUDA backend's steps and engine runs vs the reference, lossless
# speculation), bench.json (python -m hybridrt.bench.cuda: figures, the decode step's phases, a profile).
# Usage: OUT=dir bash scripts/device_check.sh
# DRY_RUN=1 runs the same steps on a machine without a GPU: the tests under TRITON_INTERPRET=1
# and the benchmark on a tiny model on the CPU (python3 must have torch and triton; the bench's
# figures mean nothing then). This is how the script is checked before a GPU is lent.
set -uo pipefail
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r hybridrt /tmp/pkg/
for d in kernels statecache specdec cli; do ln -s "$PWD/$d" "/tmp/pkg/hybridrt/$d"; done
export PYTHONPATH=/tmp/pkg:/tmp/site
REPO=$PWD
cd /tmp/pkg  # not the repo root: its hybridrt/ lacks the kernels/... subpackages
if [ "${DRY_RUN:-0}" = 1 ]; then
    export TRITON_INTERPRET=1
    BENCH_ARGS="--device cpu --tiny --dtype float32 --cache-memory 64MiB --batches 1,2 \
--prefill 24,40 --prompt-len 8 --decode-tokens 6 --repeats 1 --phase-batches 1 --phase-steps 3 \
--profile-steps 3 --backend triton ${BENCH_ARGS:-}"
    TESTS=${TESTS:-$REPO/tests/gpu/test_prefill.py}
    # fla's kernels need the tests' interpreter patches (tests/gpu/fla_interpret.py)
    BENCH=(python3 -c "import sys; sys.path.insert(0, '$REPO/tests/gpu'); import fla_interpret, \
runpy; runpy.run_module('hybridrt.bench.cuda', run_name='__main__')")
else
    BENCH=(python3 -m hybridrt.bench.cuda)
fi
{ [ "${DRY_RUN:-0}" = 1 ] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, fla, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/gpu.txt"
timeout "${TESTS_TIMEOUT:-180}" python3 -m pytest -q -p no:cacheprovider \
    ${TESTS:-$REPO/tests/gpu/test_attention.py $REPO/tests/gpu/test_cuda_backend.py} \
    2>&1 | tee "$OUT/tests.log" | tail -15
timeout "${BENCH_TIMEOUT:-240}" "${BENCH[@]}" --json "$OUT/bench.json" \
    --transformers-max-batch 32 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -70

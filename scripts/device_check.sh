#!/usr/bin/env bash
# The prepared run for a lent GPU machine (docs/gpu.md): nothing can be downloaded there, so the
# fla-core wheel travels in .whl (pip download --no-deps fla-core==0.6.0 -d .whl here) and
# hybridrt is put on the path as a symlinked package tree. Writes under $OUT: gpu.txt (versions),
# tests.log (tests/gpu/test_backend.py on the GPU: CUDA backend vs reference, lossless
# speculation), bench.json (python -m hybridrt.cudabench). Usage: OUT=dir bash scripts/device_check.sh
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
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, fla, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/gpu.txt"
timeout "${TESTS_TIMEOUT:-120}" python3 -m pytest -q -x -p no:cacheprovider ${TESTS:-$REPO/tests/gpu/test_backend.py} \
    2>&1 | tee "$OUT/tests.log" | tail -15
timeout "${BENCH_TIMEOUT:-240}" python3 -m hybridrt.cudabench --json "$OUT/bench.json" \
    --transformers-max-batch 32 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -70

#!/usr/bin/env bash
# `make gpu-check`: the GPU path on a machine with an NVIDIA GPU, Python 3.12, torch + CUDA,
# transformers and triton already installed, and NO network. The server's other packages come
# from .wheelhouse/ (`make wheelhouse` builds it where pip works); torch, transformers and
# triton are never touched. Runs, within 8 minutes: the CUDA-marked tests, bench/gpu_bench.py
# and one HTTP request through the server on cuda. Results: bench/results/gpu/.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_OUT:-bench/results/gpu}
SITE=${SPECSERVE_SITE:-/tmp/specserve-site}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1

if ! ls .wheelhouse/*.whl >/dev/null 2>&1; then
    echo "no .wheelhouse/: run 'make wheelhouse' on a machine with pip access first" >&2
    exit 2
fi
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .wheelhouse/*.whl || exit 2
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
$PY - <<'PYEOF' || exit 2
import torch, transformers
assert torch.cuda.is_available(), "no CUDA device visible"
import triton
print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}, triton {triton.__version__}")
PYEOF

status=0
echo "== CUDA-marked tests"
timeout 200 $PY -m pytest -q -m cuda -p no:cacheprovider --durations=10 tests 2>&1 | tee "$OUT_DIR/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "== bench/gpu_bench.py"
timeout 300 $PY bench/gpu_bench.py --out "$OUT_DIR/gpu_bench.md" \
    --trace "$OUT_DIR/b1_trace.json.gz" 2>&1 | tee "$OUT_DIR/gpu_bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "== one HTTP request on cuda"
timeout 60 $PY scripts/gpu_http_check.py 2>&1 | tee "$OUT_DIR/http.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu-check: $([ $status -eq 0 ] && echo passed || echo FAILED)"
exit $status

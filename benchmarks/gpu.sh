#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in under 10 minutes: the tests marked `cuda` and the
# GPU section of the benchmarks (a GPT-shaped model in bf16 against a hand loop, and the
# host syncs per step). Run from anywhere; PYTHON picks the interpreter (default: the
# checkout's .venv, else python3). OUT: where gpu-bench.json goes (default: the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-.}
"$PY" -c "import torch, sys; ok = torch.cuda.is_available(); print(torch.__version__, torch.cuda.get_device_name() if ok else 'no CUDA GPU'); sys.exit(0 if ok else 1)"
timeout 240 "$PY" -m pytest -q -m cuda tests/test_cuda.py
timeout 300 "$PY" benchmarks/run.py --device cuda --quick --json "$OUT/gpu-bench.json"

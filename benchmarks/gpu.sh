#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in under 10 minutes: the tests marked `cuda`, the GPU
# section of the benchmarks (a GPT-shaped model in bf16 against a hand loop, and the host
# syncs per step; image batches of 12.6 MB with the reader's look-ahead on and off against
# naive and prefetching hand loops), and plans/gpt.yaml trained as a user would on the GPU: in one run, and
# split in two (max_steps=100, then `resume max_steps=200`), whose models are compared.
# Run from anywhere; PYTHON picks the interpreter (default: the checkout's .venv, else
# python3, which needs torch, click, pyyaml, numpy, rich, safetensors, pytest). The checkout
# is put on PYTHONPATH, so jobrun needs no install. OUT: where the results go (default: .).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-$ROOT}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c "import torch, sys; ok = torch.cuda.is_available(); print('torch', torch.__version__, torch.cuda.get_device_name() if ok else 'no CUDA GPU'); sys.exit(0 if ok else 1)"

echo "== tests marked cuda"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -m cuda $(grep -l "mark.cuda" tests/test_*.py) || echo "CUDA TESTS FAILED"

echo "== plans/gpt.yaml on the GPU: one run of 200 steps, and 100 + resume to 200"
runs=$(mktemp -d)
( cd "$runs"
  timeout 120 "$PY" -m jobrun train "$ROOT/plans/gpt.yaml" --device cuda --run-dir whole vars.steps=200
  timeout 120 "$PY" -m jobrun train "$ROOT/plans/gpt.yaml" --device cuda --run-dir split vars.steps=200 max_steps=100
  timeout 120 "$PY" -m jobrun resume split max_steps=200
  "$PY" - <<'PY'
import torch
def flat(d, pre=""):
    for k, v in d.items():
        yield from flat(v, f"{pre}{k}.") if isinstance(v, dict) else [(pre + k, v)]
a = dict(flat(torch.load("whole/model.pt", weights_only=True)))
b = dict(flat(torch.load("split/model.pt", weights_only=True)))
assert a.keys() == b.keys() and a, (list(a), list(b))
diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
print(f"gpt on the GPU, one run vs split + resume: max |param diff| = {diff:.3g}", "(bit-exact)" if diff == 0 else "")
PY
) 2>&1 | tee "$OUT/gpu-user.log" || echo "GPT USER RUN FAILED"

echo "== replicas on the CPU of a machine with a GPU, on the image's torch (2 gloo ranks)"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -x tests/test_fsdp.py || echo "FSDP TESTS FAILED"

echo "== benchmarks, GPU section"
timeout 360 "$PY" benchmarks/run.py --device cuda --quick --json "$OUT/gpu-bench.json" || echo "GPU BENCH FAILED"
# What the table leaves out: each row's note (the image rows': what a batch costs, the
# steps of each hand loop) and its ratios per pair of adjacent epochs.
[ -f "$OUT/gpu-bench.json" ] && "$PY" - "$OUT/gpu-bench.json" <<'PY'
import json, sys
for row in json.load(open(sys.argv[1]))["sections"].get("gpu", {}).get("rows", []):
    pairs = row["extra"].get("pairs")
    pairs = pairs if isinstance(pairs, list) else None
    print(f"{row['name']}: ratio {row['ratio']:.3f}" + (f" (pairs {', '.join(f'{p:.3f}' for p in pairs)})" if pairs else ""))
    if row["note"]:
        print("   ", row["note"])
PY

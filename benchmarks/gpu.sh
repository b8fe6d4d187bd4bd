#!/usr/bin/env bash
# What a lent GPU machine runs, in one go: the CUDA tests, then the GPU benchmarks.
# Usage (from the repository root): bash benchmarks/gpu.sh OUTDIR
# Writes OUTDIR/{device.txt,tests.txt,norm_cuda.md,muon_cuda.md}; docs/benchmarks-gpu.md is written
# by hand from them. Wheels in .whl/ (for a machine whose Python lacks a dependency) are installed
# into a private target first, since such a machine may reach no package index.
set -u
out=${1:?usage: bash benchmarks/gpu.sh OUTDIR}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import sys, torch; print("torch", torch.__version__, "python", sys.version.split()[0])'; } > "$out/device.txt" 2>&1
cat "$out/device.txt"
t0=$SECONDS
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py "tests/test_adaptive.py" -k "cuda or CUDA" 2>&1 | tail -25 > "$out/tests.txt"
echo "tests: $((SECONDS - t0)) s"; cat "$out/tests.txt"
t0=$SECONDS
python3 benchmarks/norm.py --cuda-only --out "$out/norm_cuda.md" > /dev/null 2>"$out/norm.err"; echo "norm rc=$? $((SECONDS - t0)) s"
t0=$SECONDS
python3 benchmarks/muon.py --device cuda --skip-exchange --out "$out/muon_cuda.md" > /dev/null 2>"$out/muon.err"; echo "muon rc=$? $((SECONDS - t0)) s"
tail -5 "$out"/*.err

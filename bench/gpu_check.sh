#!/usr/bin/env bash
# GPU check, one GPU, under 8 minutes on an H100/H200: profile a preset's GEMMs alone and beside
# the contention probe, fit the model, print the held-out MAPE, and write the tables to OUT_DIR.
#   bash bench/gpu_check.sh [OUT_DIR] [WORKLOAD]    (defaults bench/results, llama3-8b-fsdp8)
# The run folder (measurements, meta, model) is kept beside the tables as OUT_DIR/gpu_check-WORKLOAD-run.
# Uses $PYTHON (default: the Makefile's .venv if it has CUDA, else python3), which needs a CUDA
# build of torch (Triton comes with it) and this project's dependencies.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "${1:-$root/bench/results}")
workload=${2:-llama3-8b-fsdp8}
cd "$root"
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    py=.venv/bin/python
  else
    py=python3
  fi
fi
"$py" - <<'PY' || exit 2
import importlib.util, sys
try:
    import torch
except ImportError:
    sys.exit(f"gpu_check: {sys.executable} has no torch; set PYTHON to an interpreter with a CUDA build of torch")
missing = [m for m in ("typer", "pandas", "rich", "yaml", "matplotlib", "tabulate", "triton") if importlib.util.find_spec(m) is None]
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch.cuda.is_available() is False: this check needs a CUDA GPU")
if missing:
    sys.exit(f"gpu_check: missing Python packages: {', '.join(missing)} (pip install -e '.[bench]' in a CUDA environment)")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
rm -rf "$out/gpu_check-$workload-run"  # a fresh measurement, never a resumed one
time "$py" bench/gpu_check.py --out "$out" --workload "$workload" --run "$out/gpu_check-$workload-run"

#!/usr/bin/env bash
# Everything a lent GPU session should measure, in one call (the device tool runs one command at a
# time and returns at most 8 files): the single-GPU check of three workloads (held-out MAPE, GEMM
# points vs their paired baselines, the probe's bandwidth and block placement, slowdown tables)
# and the GPU tests, then one tarball of it all plus the three reports and a log.
#   bash bench/device_session.sh OUT_DIR [WORKLOAD ...]   (default: mpt-7b-tp8-dp1 llama3-8b-fsdp8 olmoe-1b-7b-ep8)
# About 4 minutes on one H200 (gpu_check ~40 s a workload). Sets itself up as ../shared/GPU.md says:
# from the wheels in ./.whl, each package the machine lacks (optuna and what it needs; scipy, which
# `trial`'s interval needs), this checkout installed without deps.
# Exit: 0 when every step passed; 1 when some step failed (each is logged, the rest still run; the
# log's last line counts them); 2 without a CUDA GPU.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "${1:?usage: bash bench/device_session.sh OUT_DIR [WORKLOAD ...]}")
shift
workloads=("$@")
[ ${#workloads[@]} -gt 0 ] || workloads=(mpt-7b-tp8-dp1 llama3-8b-fsdp8 olmoe-1b-7b-ep8)
py=${PYTHON:-python3}
cd "$root"
if ! "$py" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  echo "device_session: $py has no torch that sees a CUDA GPU: nothing to measure here" >&2
  exit 2
fi
mkdir -p "$out"
work=$(mktemp -d)
mkdir -p "$work/results"
log="$out/device_session.log"
failed=0
step() {  # step NAME CMD...: run, log, count a failure, go on
  local name=$1; shift
  echo "== $name: $*" | tee -a "$log"
  local t0=$SECONDS
  if "$@" >>"$log" 2>&1; then
    echo "== $name: ok in $((SECONDS - t0)) s" | tee -a "$log"
  else
    echo "== $name: FAILED (exit $?) after $((SECONDS - t0)) s" | tee -a "$log"
    failed=$((failed + 1))
  fi
}
{ date -u; git rev-parse HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1; } >"$log"
missing=()
for w in .whl/*.whl; do  # a wheel's name starts with its package's, which these import as, lower-cased
  [ -f "$w" ] || continue
  pkg=$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z')
  "$py" -c "import $pkg" 2>/dev/null || missing+=("$w")
done
if [ ${#missing[@]} -gt 0 ]; then
  step "what the machine lacks, from .whl" "$py" -m pip install -q --no-index --no-deps --target "$work/site" "${missing[@]}"
  export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
fi
step "install this checkout" "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e .
export PYTHON="$py"
# what the nccl backend asks before offering NVLS (a one-GPU machine gives no NVLS either way; this
# checks the driver call itself, unrun on a GPU until a session logs it)
step "multicast support (NVLS)" "$py" -c 'from lagom_tune.backends.nccl import multicast_supported; print("CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED on GPU 0:", multicast_supported(0))'
for w in "${workloads[@]}"; do
  step "gpu_check $w" bash bench/gpu_check.sh "$work/results" "$w"
done
step "GPU tests" "$py" -m pytest -q -rfEs -p no:cacheprovider tests/test_nccl_backend.py tests/test_nccl_runtime.py tests/test_trial.py \
  -k "probe_kernel or probe_blocks or single_gpu_probe or real_nccl or joins_a_group or on_a_gpu or two_gpu"
tar -czf "$out/device_session.tar.gz" -C "$work" results
for w in "${workloads[@]}"; do
  [ -f "$work/results/gpu_check-$w.md" ] && cp "$work/results/gpu_check-$w.md" "$out/"
done
echo "device_session: $failed step(s) failed; tables in $out/device_session.tar.gz, log $log" | tee -a "$log"
[ "$failed" -eq 0 ]  # 2 failed steps would read as "no GPU"

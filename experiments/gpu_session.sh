#!/usr/bin/env bash
# Every prepared GPU benchmark in one call on a lent GPU (one machine, about 15 minutes of
# device time a task, 10 minutes a call): the flash kernel's tiles on this GPU first
# (gpu_bench.py --tune), then the train step, attention table and price with those tiles
# (gpu_bench.py --tuning), then the packed rows and the kernels alone (packed_step_gpu.py
# --compare), then host offload (offload_gpu.py), each cut to the time left. Results and a log go to $OUT (the device tool brings them back), else to
# experiments/results/.
#
# Here, before the call (the GPU image has JAX 0.11, Flax, Optax and Orbax, not OR-tools):
#   bash experiments/gpu_session.sh --wheels
# The device call, from the repository root, carrying .whl:
#   bash experiments/gpu_session.sh [SECONDS]     (default 540: leaves a 600 s call room)
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--wheels" ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        "ortools==$(python3 -c 'import ortools; print(ortools.__version__)')" immutabledict
    ls -la .whl
    exit
fi

budget=${1:-540}
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }
out=${OUT:-experiments/results}
mkdir -p "$out"
log="$out/gpu_session.log"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD:$PWD/experiments:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,memory.total --format=csv;
  python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'; } 2>&1 | tee "$log"

run() {  # seconds, then the command
    local secs=$1; shift
    if [ "$secs" -lt 30 ]; then echo "skipped (no time left): $*" | tee -a "$log"; return; fi
    echo "== $* (at most ${secs}s)" | tee -a "$log"
    timeout "$secs" "$@" 2>&1 | tee -a "$log"
    echo "== rc ${PIPESTATUS[0]}, $(( $(date +%s) - start ))s in" | tee -a "$log"
}
# shares of the time left: tiles 25%, step 40%, packed rows (with the kernels compared
# alone) 60% of what is then left, offload the rest
run $(( $(left) / 4 )) python3 experiments/gpu_bench.py --tune \
    --budget-s $(( $(left) / 4 - 30 )) --out "$out/flash_tuning.json"
run $(( $(left) * 8 / 15 )) python3 experiments/gpu_bench.py --tuning "$out/flash_tuning.json" \
    --budget-s $(( $(left) * 8 / 15 - 60 )) --out "$out/gpu_bench.json"
run $(( $(left) * 3 / 5 )) python3 experiments/packed_step_gpu.py --compare \
    --budget-s $(( $(left) * 3 / 5 - 60 )) --out "$out/packed_step_gpu.json"
run $(( $(left) - 10 )) python3 experiments/offload_gpu.py --out "$out/offload_gpu.json"

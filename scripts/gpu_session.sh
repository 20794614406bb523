#!/usr/bin/env bash
# One GPU-machine session: install the carried wheels (.whl/, see docs/benchmarks.md),
# then run the named steps, each logged to $OUT/<step>.log (results JSON to $OUT too).
#   bash scripts/gpu_session.sh tests evoflash transition smooth_lddt step
set -uo pipefail
OUT="${OUT:-/tmp/of3mf-out}"
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
fi
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

run() {  # run <step> <seconds> <command...>
    local step=$1 limit=$2
    shift 2
    echo "=== $step"
    timeout "$limit" "$@" >"$OUT/$step.log" 2>&1
    echo "exit $? ($step)" | tee -a "$OUT/$step.log"
    tail -n 25 "$OUT/$step.log"
}

for step in "$@"; do
    case "$step" in
        tests) run tests 420 python3 -m pytest tests/kernels tests/extensions -q -x \
            -p no:cacheprovider --durations=15 ;;
        evoflash) run evoflash 300 python3 scripts/gpu_check_evoflash.py ;;
        transition) run transition 240 python3 scripts/gpu_check_transition.py ;;
        smooth_lddt) run smooth_lddt 240 python3 scripts/gpu_check_smooth_lddt.py ;;
        bench-*) run "$step" "${BENCH_LIMIT:-300}" python3 -m of3_megafold.cli bench \
            "${step#bench-}" --out-dir "$OUT" ;;
        step) run step 540 python3 scripts/gpu_step.py "$OUT/step.json" ;;
        *) echo "unknown step $step"; exit 2 ;;
    esac
done

#!/usr/bin/env bash
# One GPU-machine session, run from the repository root: install the carried wheels
# (.whl/; docs/benchmarks.md, "Re-running them"), then run the named steps, each logged to $OUT/<step>.log (results JSON to $OUT too).
# A step may carry its own time limit in seconds (bench-attention@200) and a tag that
# names its log and results (step.r1 -> step.r1.log, step.r1.json), so one session can
# run a step twice:
#   bash tools/gpu_session.sh tests evoflash profile bench-transition@90 "step@200 --no-max-crop"
#   bash tools/gpu_session.sh "ncu tri1024 transition768"   # hardware counters (Nsight Compute)
# Options after a step's name go to its script (tests: pytest arguments instead of
# tests/kernels tests/extensions):
#   bash tools/gpu_session.sh "tests.swiglu@300 tests/kernels/test_swiglu_transition.py -k gpu_" \
#       "evoflash.every@150 --every-config --no-check --sizes --no-diffusion --no-trunk"
#   bash tools/gpu_session.sh "bench-train.768@560 --provider stock-triton --tokens 768 \
#       --steps 30 --max-minutes 6.5 --resume-dir /tmp/of3mf-resume"   # again to finish
# Several sessions may run at once on a multi-GPU machine (CUDA_VISIBLE_DEVICES, own
# OUT): the wheels are installed once.
# The kit against cuEquivariance, DeepSpeed and Liger-Kernel: carry
# .whl, then .whl-rivals-1, then .whl-rivals-2, one folder per call, each call with
# OF3MF_SITE=$PWD/.site; build DeepSpeed's op once (ds-build, ~8 min), then
#   OF3MF_SITE=$PWD/.site bash tools/gpu_session.sh rivals \
#       "step --providers stock-cueq-tf32,kit,stock-triton --tokens 768 --no-max-crop"
set -uo pipefail
OUT="${OUT:-/tmp/of3mf-out}"
mkdir -p "$OUT"
# Where the wheels go: OF3MF_SITE, else /tmp/site. A folder in the checkout's root
# (OF3MF_SITE=$PWD/.site, git-ignored) outlives a call on a warm machine, so wheels
# too large to travel in one call can come in several.
SITE="${OF3MF_SITE:-/tmp/site}"
install_wheels() {  # install_wheels <folder> <marker>: once per machine and folder
    [ -f "$SITE/.of3mf-$2" ] && return 0
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" "$1"/*.whl || exit 1
    touch "$SITE/.of3mf-$2"
}
[ -d .whl ] && install_wheels .whl installed
# Other projects' kernels for the side-by-side benchmarks (of3_megafold/bench/rivals.py),
# carried as .whl-rivals*/ folders (docs/benchmarks.md, "Re-running them")
for folder in .whl-rivals*; do
    [ -d "$folder" ] && install_wheels "$folder" "${folder#.whl-}"
done
if [ -f "$SITE/.of3mf-installed" ]; then
    # rdkit's drawing module links libXrender, which some GPU machines lack;
    # OF3 imports it (through pdbeccdutils) but never draws
    if ! python3 -c "import sys; sys.path.insert(0, '$SITE'); import rdkit.Chem.Draw" 2>/dev/null; then
        mv "$SITE/rdkit/Chem/Draw" "$SITE/rdkit/Chem/Draw.unloadable"
        mkdir "$SITE/rdkit/Chem/Draw"
        echo '"""Import-only stand-in: the real module needs libXrender (gpu_session.sh)."""' \
            >"$SITE/rdkit/Chem/Draw/__init__.py"
    fi
    export PYTHONPATH="$SITE:$PWD"
else  # no wheels carried: the kit's kernels need only torch and Triton
    export PYTHONPATH="$PWD"
fi
# DeepSpeed builds its evoformer op on first use: CUTLASS's headers from the
# nvidia-cutlass wheel, the build kept beside the wheels
if [ -d "$SITE/cutlass_library/source" ]; then
    export CUTLASS_PATH="$SITE/cutlass_library/source" TORCH_EXTENSIONS_DIR="$SITE/.torch-extensions"
    # DeepSpeed's builder cannot parse the image's "9.0a"; the op has no sm_90a code
    export TORCH_CUDA_ARCH_LIST=9.0
fi
# OF3's experiment runner imports wandb, which the wheels leave out (logging is off)
python3 -c "import wandb" 2>/dev/null || export PYTHONPATH="$PYTHONPATH:$PWD/tools/gpu_stubs"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
# bench train's demo set, built by tools/pack_device_wheels.py (this machine cannot)
[ -d .demo-cache ] && export OF3_MEGAFOLD_CACHE="$PWD/.demo-cache"
# EvoFlash keeps its autotuning choices in Triton's cache (cache_results): bring the
# choices of an earlier machine (carried as .triton-autotune/) and send this
# machine's back as $OUT/triton-autotune.tgz (unpack it into .triton-autotune/), so a fresh machine skips the ~3 min of
# tuning. Only the small *.autotune.json files travel, not the compiled kernels.
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/of3mf-triton-cache}"
mkdir -p "$TRITON_CACHE_DIR"
[ -d .triton-autotune ] && cp -r .triton-autotune/. "$TRITON_CACHE_DIR/"
save_autotune() {
    (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -print0 |
        tar -czf "$OUT/triton-autotune.tgz" --null -T -) 2>/dev/null
}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

run() {  # run <step> <seconds> <command...>
    local step=$1 limit=$2
    shift 2
    echo "=== $step"
    timeout "$limit" "$@" >"$OUT/$step.log" 2>&1
    echo "exit $? ($step)" | tee -a "$OUT/$step.log"
    save_autotune  # after every step: a call cut short keeps what was tuned
    tail -n 25 "$OUT/$step.log"
}

of3_test_stubs() {  # import-only stand-ins (tools/gpu_stubs/) for what OF3's tests import
    python3 -c "import boto3, botocore.paginate, awscrt, func_timeout, kalign" 2>/dev/null ||
        export PYTHONPATH="$PYTHONPATH:$PWD/tools/gpu_stubs"
    local data
    data="$(python3 -c 'import openfold3, os; print(os.path.dirname(openfold3.__file__))')/tests/test_data"
    mkdir -p "$data"
    # OF3's regression snapshots (test_triangular_attention's ndarrays_regression),
    # copied from an openfold3 install into the ignored .of3-snapshots/ and carried
    [ -d .of3-snapshots ] && mkdir -p "$data/snapshots" && cp -r .of3-snapshots/. "$data/snapshots/"
}

ncu_binary() {  # Nsight Compute: on the PATH, else the image's install
    command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1
}

for spec in "$@"; do
    read -r head extra <<<"$spec"
    name=${head%@*}
    limit=""
    [ "$head" != "$name" ] && limit=${head#*@}
    step=${name%%.*}
    case "$step" in
        # shellcheck disable=SC2086  # $extra: pytest arguments instead of the two folders
        tests) run "$name" "${limit:-420}" python3 -m pytest ${extra:-tests/kernels tests/extensions} \
            -q --maxfail=10 -p no:cacheprovider --durations=15 ;;
        # shellcheck disable=SC2086  # $extra: options for gpu_check_evoflash.py
        evoflash) run "$name" "${limit:-300}" python3 -m tools.gpu_check_evoflash $extra ;;
        # shellcheck disable=SC2086  # $extra: options for gpu_check_transition.py
        transition) run "$name" "${limit:-240}" python3 -m tools.gpu_check_transition $extra ;;
        # shellcheck disable=SC2086  # $extra: options for gpu_check_sequence_parallel.py
        sp) run "$name" "${limit:-180}" python3 -m tools.gpu_check_sequence_parallel $extra ;;
        # shellcheck disable=SC2086  # $extra: options for the sharded trimul check
        sp-trimul) run "$name" "${limit:-240}" python3 -m tools.gpu_check_sharded_triangle_multiplication \
            --out "$OUT/$name.json" $extra ;;
        # a CUDA-graph key on and off in training steps (--key rollout|trunk)
        # shellcheck disable=SC2086  # $extra: options for gpu_check_cuda_graphs.py
        graphs) run "$name" "${limit:-420}" python3 -m tools.gpu_check_cuda_graphs \
            "$OUT/$name.json" $extra ;;
        smooth_lddt) run smooth_lddt "${limit:-240}" python3 -m tools.gpu_check_smooth_lddt ;;
        # shellcheck disable=SC2086
        profile-step) run profile-step "${limit:-480}" python3 -m tools.gpu_profile_step \
            "$OUT/profile_step.txt" $extra ;;
        # OF3's CUDA-only tests with every kit extension forced (the GPU machine lacks
        # OF3's S3 client packages, which its test conftest imports, and the repacked
        # wheel has no tests/test_data: empty stand-ins; the CUDA tests need neither)
        of3-tests) of3_test_stubs
                   run of3-tests "${limit:-300}" python3 -m of3_megafold.cli test-of3 \
                       --extensions all --subset ci test_of3_model.py -q -rfs -p no:warnings --continue-on-collection-errors ;;
        # block sizes of the triangle-multiplication kernels (diagnostic)
        # shellcheck disable=SC2086  # $extra: options for the sweep
        sweep-tm) run sweep-tm "${limit:-180}" python3 -m tools.gpu_sweep_triangle_multiplication $extra ;;
        # launch shapes of the LayerNorm kernels (diagnostic)
        # shellcheck disable=SC2086  # $extra: options for the sweep
        sweep-ln) run sweep-ln "${limit:-180}" python3 -m tools.gpu_sweep_layer_norm $extra ;;
        # hardware counters of the kit's kernels, one ncu process per case
        # (tools/gpu_ncu.py; $extra: case names, default all)
        # shellcheck disable=SC2086
        ncu) ncu_bin=$(ncu_binary)
             [ -n "$ncu_bin" ] || { echo "=== $name: Nsight Compute (ncu) not found"; continue; }
             for case in ${extra:-$(python3 -m tools.gpu_ncu --list)}; do
                 run "ncu-$case" "${limit:-240}" "$ncu_bin" --profile-from-start off \
                     --clock-control none --section SpeedOfLight \
                     --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
                     --section LaunchStats --section Occupancy --section SchedulerStats \
                     --section WarpStateStats --section InstructionStats \
                     python3 -m tools.gpu_ncu "$case"
             done ;;
        profile) run profile "${limit:-180}" python3 -m tools.gpu_profile_kernels "$OUT/profile.txt" ;;
        # shellcheck disable=SC2086  # $extra: options for gpu_profile_module.py
        profile-module) run profile-module "${limit:-180}" python3 -m tools.gpu_profile_module \
            "$OUT/profile_module.txt" $extra ;;
        host) run host "${limit:-240}" python3 -m tools.gpu_profile_kernels "$OUT/host.txt" --host ;;
        # where the kit's training step spends host time (cProfile; $extra: tokens)
        # shellcheck disable=SC2086
        host-step) run host-step "${limit:-300}" python3 -m tools.gpu_host_profile_step \
            ${extra:-384} "$OUT" ;;
        # DeepSpeed's evoformer op, built ahead of the benchmarks that time it
        ds-build) run ds-build "${limit:-560}" python3 -c "
import time; t = time.time()
from deepspeed.ops.op_builder import EvoformerAttnBuilder
EvoformerAttnBuilder().load()
print(f'built in {time.time() - t:.0f} s')" ;;
        # the kit against cuEquivariance, DeepSpeed and Liger-Kernel (tools/gpu_rivals.py)
        # shellcheck disable=SC2086  # $extra: options for gpu_rivals.py
        rivals) run "$name" "${limit:-540}" python3 -m tools.gpu_rivals "$OUT" $extra ;;
        # shellcheck disable=SC2086  # $extra: options for the bench subcommand
        bench-*) run "$name" "${limit:-300}" python3 -m of3_megafold.cli bench \
            "${step#bench-}" --out-dir "$OUT" $extra ;;  # not for bench-step: use step
        # shellcheck disable=SC2086  # $extra: options for gpu_step.py
        step) run "$name" "${limit:-540}" python3 -m tools.gpu_step "$OUT/$name.json" $extra ;;
        # one process per GPU (all of them, or SP_RANKS), sequence parallelism over all
        # shellcheck disable=SC2086  # $extra: options for gpu_step_sp.py
        step-sp) run "$name" "${limit:-540}" python3 -m torch.distributed.run --standalone \
            --nproc_per_node "${SP_RANKS:-$(nvidia-smi -L | wc -l)}" \
            -m tools.gpu_step_sp "$OUT/$name.json" $extra ;;
        *) echo "unknown step $step"; exit 2 ;;
    esac
done

#!/usr/bin/env bash
# The GPU checks, in one run on a lent GPU machine (torch, triton, transformers, peft
# installed; no registry, no virtualenv). Run from the repository root:
#   bash benchmarks/gpu_check.sh            # logs and results under $OUT (default ./gpu-out)
#   bash benchmarks/gpu_check.sh --smoke    # the same steps, the benchmarks at --smoke size
#   bash benchmarks/gpu_check.sh --dry-run  # where there is no GPU: checks this script itself
# Steps and their time limits, in the order they run (500 s in all, each about 1.3x what it
# took on the first H200 run, 2026-12-04, bench and attention 1.5x, the engine's later phases
# (decode matrix, FP8, DoRA) unmeasured; --budget, 540 s by default,
# caps the whole run: a step gets at most what is left, and one with under 20 s left is skipped,
# so that the run ends within 9 minutes, one command on the lent machine being 10 at most):
#   tests-gpu   110 s  the `gpu` tests: compiled SGMV and attention kernels in bf16, the sampler
#                      on the device, structured bitmasks, and the CUDA defaults together (the
#                      tiny model in fp32 with arena + Triton SGMV/BGMV + Triton attention, eager
#                      and from real CUDA graphs, against the CPU torch path and HF + PEFT),
#                      and a decode step with DoRA rows replayed from a real CUDA graph
#   tests-cuda   60 s  the SGMV, BGMV, MoE-expert, W8A16 and W4A16 kernel tests on CUDA tensors (TRITON_INTERPRET
#                      unset; pytest-xdist spreads the compiles over 8 workers where it is there)
#   engine      200 s  the engine end to end: an 8B-shaped bf16 model from a sharded checkpoint
#                      (load time, host memory), decode steps against the roofline, CUDA
#                      graphs on and off, HF + PEFT on the same adapters (engine_gpu.py), and
#                      its decode matrix (_decode_matrix.py): 64 and 256 rows, 8 and 64
#                      adapters, greedy and temperature 0.8 / top-p 0.9, graphs off and on;
#                      per case the step against its roofline (weights, adapters, KV and the
#                      logits' fp32 passes) and the host time per step (the step's wall less
#                      the forward's and lm_head's, from CUDA events), printed as it runs;
#                      then DoRA (issue 33): first-ever loads (g computed on the device) and
#                      decode steps of DoRA adapters against new plain ones of the same rank
#   bench        20 s  the SGMV kernel benchmark (kernels_gpu.py)
#   shared-pool  90 s  adapters inside the KV cache (the CUDA default) against adapters in
#                      their own buffers, tokens compared in fp32 (shared_pool_gpu.py)
#   attention    20 s  the paged attention kernel against the torch gather + SDPA path and the
#                      HBM roofline (attention_gpu.py)
# --steps a,b,...: only those steps (e.g. a second call for what the first had no time for).
# A failing step does not stop the others, but the script exits non-zero if any failed; each
# benchmark's results JSON is copied to $OUT. Without a CUDA device it says so and exits 0
# (skipped).
# --dry-run (implies --smoke) runs where there is no GPU (CUDA hidden where there is one), in
# well under 2 minutes on 2 cores: each step in its CPU form, or skipped with the reason in the
# summary. The kernel test steps run a few of the same files' non-`gpu` tests (-k
# "$DRY_RUN_TESTS": the argument checks, which launch nothing; all of them take ~40 s in
# Triton's interpreter, the suite runs them, and a dry run checks the runbook, not the
# kernels); a benchmark takes its CPU smoke path where it has one (_run.py's
# CPU_SMOKE_ARGS, which `make bench-smoke` uses too), else it is skipped (needs CUDA).
set -u

OUT="${OUT:-./gpu-out}"
PYTHON="${PYTHON:-python}"
DRY_RUN_TESTS="reject or without_launching"
smoke=()
dry_run=0
only=""
budget=540
while [ "$#" -gt 0 ]; do
    arg="$1"
    shift
    case "$arg" in
        --steps) only=",${1:?--steps needs a list},"; shift ;;
        --steps=*) only=",${arg#--steps=}," ;;
        --budget) budget="${1:?--budget needs seconds}"; shift ;;
        --budget=*) budget="${arg#--budget=}" ;;
        --smoke) smoke=(--smoke) ;;
        --dry-run) dry_run=1 smoke=(--smoke) ;;
        -h | --help)
            echo "usage: bash benchmarks/gpu_check.sh [--smoke | --dry-run] [--steps a,b] [--budget S]"
            echo "       (OUT=dir PYTHON=python)"
            echo "  --smoke    the benchmarks at tiny sizes (seconds): checks they run, not speed"
            echo "  --dry-run  without a GPU: each step's CPU form at smoke size, or skipped"
            echo "  --steps    only these steps: tests-gpu,tests-cuda,engine,bench,shared-pool,attention"
            echo "  --budget   seconds for the whole run (540): a step gets at most what is left"
            exit 0
            ;;
        *)
            echo "gpu_check: unknown argument: $arg" >&2
            exit 2
            ;;
    esac
done
if ! "$PYTHON" -c 'import torch' >/dev/null 2>&1; then
    echo "gpu_check: $PYTHON cannot import torch" >&2
    exit 1
fi
if [ "$dry_run" = 1 ]; then
    export CUDA_VISIBLE_DEVICES=""  # the CPU forms, even on a machine with a GPU
    export TRITON_INTERPRET=1
    # tiny models run faster on one torch thread (as in `make bench-smoke`, _run.py)
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
elif ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu_check: no CUDA device: skipped"
    exit 0
else
    unset TRITON_INTERPRET  # compiled kernels: the interpreter gets bf16 tl.dot wrong
fi
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}."
export HF_HUB_OFFLINE=1
suffix=$([ "${#smoke[@]}" -gt 0 ] && echo .smoke)
marker="$OUT/.step-started"

failed=()
summary=()
note=""  # said after a step's time in the summary (what form it ran in)

selected() {  # selected NAME: whether --steps (if given) names NAME
    [ -z "$only" ] || [[ "$only" == *",$1,"* ]]
}

step() {  # step NAME SECONDS COMMAND... : run with a time limit, log to $OUT/NAME.log
    local name="$1" limit="$2"
    shift 2
    local start=$SECONDS rc left=$((budget - SECONDS))
    if ! selected "$name"; then
        note=""
        return
    fi
    if [ "$left" -lt 20 ]; then
        skip "$name" "no time left in the ${budget} s budget"
        note=""
        return
    fi
    # the limits are a GPU's; the dry run interprets Triton on a CPU that may be shared
    [ "$dry_run" = 1 ] && limit=$((limit * 3))
    [ "$left" -lt "$limit" ] && limit=$left
    echo "== $name: $*"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    tail -n 5 "$OUT/$name.log"
    if [ "$rc" -eq 0 ]; then
        summary+=("ok      $name ($((SECONDS - start)) s$note)")
    elif [ "$rc" -eq 3 ] && [[ "$*" == *benchmarks/* ]]; then  # ran, missed a goal (_common.py)
        summary+=("GOALS   $name (ran, a goal not met, $((SECONDS - start)) s, see $OUT/$name.log)")
        failed+=("$name")
    else
        [ "$rc" -eq 124 ] && echo "   (timed out after $limit s)"
        summary+=("FAILED  $name (rc $rc, $((SECONDS - start)) s, see $OUT/$name.log)")
        failed+=("$name")
    fi
    note=""
}

skip() {  # skip NAME REASON: a step that cannot run here, and why, in the summary
    echo "== $1: skipped: $2"
    summary+=("skipped $1: $2")
}

cpu_smoke_args() {  # the arguments of SCRIPT's smoke run on CPU (_run.CPU_SMOKE_ARGS), or status 1
    PYTHONPATH=benchmarks "$PYTHON" -c 'import sys
from _run import CPU_SMOKE_ARGS
args = CPU_SMOKE_ARGS.get(sys.argv[1])
sys.exit(1) if args is None else print(*args)' "$1"
}

bench_step() {  # bench_step NAME SECONDS SCRIPT: a benchmark, its results JSON copied to $OUT
    local name="$1" limit="$2" script="$3"
    local result args cpu
    selected "$name" || return 0
    result=$(basename "$script" .py)
    args=(${smoke[@]+"${smoke[@]}"})
    if [ "$dry_run" = 1 ]; then
        if ! cpu=$(cpu_smoke_args "$result"); then
            skip "$name" "needs CUDA ($script has no CPU smoke path)"
            return
        fi
        # shellcheck disable=SC2206  # split on purpose: CPU_SMOKE_ARGS hold no spaces
        args+=($cpu)
        note=", its CPU smoke path"
    fi
    touch "$marker"
    step "$name" "$limit" "$PYTHON" "$script" ${args[@]+"${args[@]}"}
    local file="benchmarks/results/$result$suffix.json"
    if [ -n "$(find "$file" -newer "$marker" 2>/dev/null)" ]; then  # written by this step
        cp "$file" "$OUT/"
    fi
}

{
    echo "date: $(date -u +%FT%TZ)"
    if [ "$dry_run" = 1 ]; then
        echo "dry run: each step's CPU form at smoke size, or skipped (CUDA hidden)"
    fi
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    fi
    "$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "cuda available", torch.cuda.is_available())' 2>&1
} | tee "$OUT/env.log"

kernel_tests=(tests/dataplane/test_kernels_triton.py)
gpu_tests=("${kernel_tests[@]}" tests/dataplane/test_attention_triton.py)
cuda_tests=("${kernel_tests[@]}")
workers=()
if [ "$dry_run" = 1 ]; then
    select_gpu=(-m "not gpu" -k "$DRY_RUN_TESTS")
    select_cuda=(-m "not gpu" -k "$DRY_RUN_TESTS")
    note=", CPU: Triton's interpreter, not its gpu tests (they need CUDA), -k subset"
else
    select_gpu=(-m gpu)
    select_cuda=(-m "not gpu")
    gpu_tests+=(tests/dataplane/test_host_bytes.py tests/dataplane/test_structured.py
        tests/dataplane/test_cuda_defaults.py tests/dataplane/test_devices.py
        tests/dataplane/test_dora_kernels.py)
    cuda_tests+=(tests/dataplane/test_kernels_bgmv.py tests/dataplane/test_lora_experts_triton.py
        tests/dataplane/test_w8a16_triton.py tests/dataplane/test_w4a16_triton.py)
    if "$PYTHON" -c 'import xdist' >/dev/null 2>&1; then
        workers=(-n 8)  # the kernels' compiles, side by side
    fi
fi
step tests-gpu 110 "$PYTHON" -m pytest -q -p no:cacheprovider "${select_gpu[@]}" \
    --junitxml="$OUT/tests-gpu.xml" "${gpu_tests[@]}"
[ "$dry_run" = 1 ] && note=", CPU: Triton's interpreter, -k subset"
step tests-cuda 60 "$PYTHON" -m pytest -q -p no:cacheprovider "${select_cuda[@]}" \
    ${workers[@]+"${workers[@]}"} --junitxml="$OUT/tests-cuda.xml" "${cuda_tests[@]}"
bench_step engine 200 benchmarks/engine_gpu.py
bench_step bench 20 benchmarks/kernels_gpu.py
bench_step shared-pool 90 benchmarks/shared_pool_gpu.py
bench_step attention 20 benchmarks/attention_gpu.py
rm -f "$marker"

echo "== summary ($OUT)"
{
    [ "$dry_run" = 1 ] && echo "dry run (no GPU): the steps' CPU forms at smoke size"
    printf '%s\n' "${summary[@]}"
} | sed 's/^/  /' | tee "$OUT/summary.txt"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
if [ "$dry_run" = 1 ]; then
    echo "dry run: every step ran in its CPU form or was skipped (see above)"
else
    echo "all steps passed"
fi

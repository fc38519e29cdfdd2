#!/usr/bin/env bash
# The SGMV kernels' GPU checks, in one run on a lent GPU machine (torch, triton, transformers,
# peft installed; no registry, no virtualenv). Run from the repository root:
#   bash benchmarks/gpu_check.sh            # logs and results under $OUT (default ./gpu-out)
#   bash benchmarks/gpu_check.sh --smoke    # the same steps, the benchmarks at --smoke size
# Steps: the kernel tests on CUDA with compiled Triton (the bf16 `gpu` tests, then the rest of
# the module, which runs on CUDA tensors when TRITON_INTERPRET is unset), then the benchmark,
# then adapters inside the KV cache (the CUDA default) against adapters in their own buffers,
# then the paged attention kernel against the torch gather + SDPA path and the HBM roofline
# (its bf16 `gpu` tests run in the first step).
# Each step has a time limit (470 s in all) so the whole run ends within 8 minutes; a failing
# step does not stop the others, but the script exits non-zero if any failed. Without a CUDA
# device it says so and exits 0 (skipped).
set -u

OUT="${OUT:-./gpu-out}"
PYTHON="${PYTHON:-python}"
smoke=()
for arg in "$@"; do
    case "$arg" in
        --smoke) smoke=(--smoke) ;;
        -h | --help)
            echo "usage: bash benchmarks/gpu_check.sh [--smoke]  (OUT=dir PYTHON=python)"
            echo "  --smoke  the benchmarks at tiny sizes (seconds): checks they run, not speed"
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
if ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu_check: no CUDA device: skipped"
    exit 0
fi
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}."
export HF_HUB_OFFLINE=1
unset TRITON_INTERPRET  # compiled kernels: the interpreter gets bf16 tl.dot wrong

failed=()
summary=()

step() {  # step NAME SECONDS COMMAND... : run with a time limit, log to $OUT/NAME.log
    local name="$1" limit="$2"
    shift 2
    local start=$SECONDS rc
    echo "== $name: $*"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    tail -n 5 "$OUT/$name.log"
    if [ "$rc" -eq 0 ]; then
        summary+=("ok     $name ($((SECONDS - start)) s)")
    elif [ "$rc" -eq 3 ] && [[ "$*" == *benchmarks/* ]]; then  # ran, missed a goal (_common.py)
        summary+=("GOALS  $name (ran, a goal not met, $((SECONDS - start)) s, see $OUT/$name.log)")
        failed+=("$name")
    else
        [ "$rc" -eq 124 ] && echo "   (timed out after $limit s)"
        summary+=("FAILED $name (rc $rc, $((SECONDS - start)) s, see $OUT/$name.log)")
        failed+=("$name")
    fi
}

{
    echo "date: $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "cuda available", torch.cuda.is_available())' 2>&1
} | tee "$OUT/env.log"

step tests-gpu 100 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu \
    --junitxml="$OUT/tests-gpu.xml" tests/dataplane/test_kernels_triton.py \
    tests/dataplane/test_attention_triton.py
step tests-cuda 100 "$PYTHON" -m pytest -q -p no:cacheprovider -m "not gpu" \
    --junitxml="$OUT/tests-cuda.xml" tests/dataplane/test_kernels_triton.py
step bench 120 "$PYTHON" benchmarks/kernels_gpu.py ${smoke[@]+"${smoke[@]}"}
step shared-pool 80 "$PYTHON" benchmarks/shared_pool_gpu.py ${smoke[@]+"${smoke[@]}"}
step attention 70 "$PYTHON" benchmarks/attention_gpu.py ${smoke[@]+"${smoke[@]}"}
suffix=$([ "${#smoke[@]}" -gt 0 ] && echo .smoke)
for result in kernels_gpu shared_pool_gpu attention_gpu; do
    if [ -f "benchmarks/results/$result$suffix.json" ]; then
        cp "benchmarks/results/$result$suffix.json" "$OUT/"
    fi
done

echo "== summary ($OUT)"
printf '  %s\n' "${summary[@]}" | tee "$OUT/summary.txt"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "all steps passed"

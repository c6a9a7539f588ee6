#!/usr/bin/env bash
# Every check of bert-ds that needs a GPU, in one command, with its results in one folder:
#
#   benchmarks/gpu_checks.sh [OUT_DIR]     (default: benchmarks/results/<gpu>-<yyyy-mm-dd>)
#
#   1. python -m bert_ds.kernels.build --recheck             build the extension, self-check every op and time
#                                                     each against its native alternative (auto's verdicts)
#      python -m bert_ds.kernels.inspect --summary            registers, spills, CTAs per SM as that machine's nvcc builds them
#   2. pytest tests/kernels/test_cuda_ops.py          every fused op and gradient against its reference
#   3. python -m bert_ds.kernels.bench                        each op against torch eager / compile / SDPA
#   4. python -m bert_ds.tools.bench                        (a) fused, (b) torch, (c) transformers at
#                                                     BERT-Base seq 128 and 512, and the projection
#   5. ./run.sh (the main job, MAIN_STEPS steps)      only where DeepSpeed imports: training on the
#                                                     GPU under ZeRO-1 bf16 with LAMB, export, fill-mask
#   6. python -m bert_ds.train --preset base          only where DeepSpeed imports: BERT-Base at seq 128
#                                                     through the engine path a user runs (ZeRO-1, bf16,
#                                                     LAMB, kernels=auto) for BASE_STEPS steps; its real
#                                                     tokens/s and MFU (summary in train_base_summary.json)
#
# Run it from the repository root with a Python that has torch (CUDA), transformers, tokenizers,
# safetensors and numpy; steps 1-4 need neither DeepSpeed nor datasets. Every step runs even if an
# earlier one failed; the exit status is the number of steps that failed. Extra arguments for
# the model bench go in BENCH_ARGS (e.g. BENCH_ARGS="--preset base,large").
set -u -o pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
# The model in the device name: "NVIDIA H100 80GB HBM3" -> H100, "NVIDIA A100-SXM4-80GB" -> A100.
gpu=$("$python" -c '
import re, torch
if torch.cuda.is_available():
    name = torch.cuda.get_device_name().removeprefix("NVIDIA ")
    print((re.search(r"\b[A-Z]+\d+\w*", name) or re.search(r"\w+", name)).group(0))' 2>/dev/null)
if [[ -z $gpu ]]; then
    echo "gpu_checks.sh: no CUDA device is visible to $python" >&2
    exit 2
fi
out=${1:-benchmarks/results/$gpu-$(date +%Y-%m-%d)}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
failed=0
# ONLY="name ..." runs just those steps (a lease split over several calls).
wanted() { [[ -z ${ONLY:-} || " $ONLY " == *" $1 "* ]]; }
step() {  # step NAME BUDGET_S COMMAND...: run within BUDGET_S, keep stdout+stderr in OUT/NAME.log, count a failure
    local name=$1 budget=$2; shift 2
    wanted "$name" || return 0
    echo "== $name (budget ${budget}s): $*"
    local start=$SECONDS
    timeout --kill-after=15 "$budget" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "$name $rc $((SECONDS - start))" >> "$out/steps.txt"
    if [[ $rc -ne 0 ]]; then
        [[ $rc -eq 124 || $rc -eq 137 ]] && echo "== $name ran past its ${budget}s budget"
        echo "== $name FAILED (exit $rc, $((SECONDS - start))s)"; failed=$((failed + 1))
    else
        echo "== $name ok ($((SECONDS - start))s)"
    fi
}
# Wheels the GPU machine lacks (deepspeed and its requirements), carried in $KIT.
kit=${KIT:-.whl}
if ! "$python" -c 'import deepspeed' >/dev/null 2>&1 && compgen -G "$kit/*.whl" >/dev/null; then
    site=$(mktemp -d)
    if "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$kit"/*.whl; then
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        echo "== kit: installed $(cd "$kit" && ls *.whl | sed 's/-[0-9].*//' | tr '\n' ' ')into $site"
    else
        echo "== kit: pip could not install $kit/*.whl"
    fi
fi
step kernels_build 240 "$python" -m bert_ds.kernels.build --recheck
step kernels_inspect 90 "$python" -m bert_ds.kernels.inspect --summary
step test_cuda_ops 180 "$python" -m pytest -q -rs tests/kernels/test_cuda_ops.py
step kernels_bench 150 "$python" -m bert_ds.kernels.bench --json "$out/kernels_bench.json"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of words
step bench 300 "$python" -m bert_ds.tools.bench --json "$out/bench.json" --markdown "$out/bench.md" ${BENCH_ARGS:-}
if "$python" -c 'import deepspeed' >/dev/null 2>&1; then
    run_dir=$(mktemp -d)
    step main_job 300 env VENV="$("$python" -c 'import sys; print(sys.prefix)')" SETUP=none RUN_DIR="$run_dir" \
        STEPS="${MAIN_STEPS:-300}" ./run.sh
    step train_base 240 "$python" -m bert_ds.train --data "$run_dir/data/train" --output "$run_dir/base" \
        --preset base --seq-len 128 --micro-batch-size "${BASE_MICRO:-64}" --global-batch-size "${BASE_MICRO:-64}" \
        --steps "${BASE_STEPS:-60}" --ds-config zero1_bf16.json --optimizer lamb --kernels auto \
        --no-progress --no-tensorboard
    cp "$run_dir/base/summary.json" "$out/train_base_summary.json" 2>/dev/null || true
else
    echo "== main_job skipped: DeepSpeed does not import in $python (carry its wheel to run it)"
fi
echo "== results in $out ($failed step(s) failed)"
exit "$failed"

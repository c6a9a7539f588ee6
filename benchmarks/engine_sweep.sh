#!/usr/bin/env bash
# BERT-Base through the engine path a user runs (python -m bert_ds.train: DeepSpeed ZeRO-1,
# bf16, LAMB), in several forms side by side, each with its last steps profiled by stage:
#
#   benchmarks/engine_sweep.sh DATA OUT_DIR
#       DATA: a dataset built with a 30,522-word vocabulary (BERT's decoder width), e.g. as
#             benchmarks/gpu_checks.sh builds one for its train_base step
#
#   variant        what changes against base-mb512 (global batch 1,024 sequences of 128 in all)
#   base-mb512     micro-batch 512, 2 accumulation steps (the recipe's), zero1_bf16.json, kernels=auto
#   base-mb256     micro-batch 256, 4 accumulation steps: twice the host work per token
#   base-mb1024    micro-batch 1,024, no accumulation
#   overlap        zero1_bf16.json with overlap_comm on: DeepSpeed's per-parameter gradient
#                  hooks on every micro-batch, a side stream and its events
#   torch-ops      kernels=torch: PyTorch's own ops in the same engine
#   compiled       --compile-layers: each encoder layer under torch.compile, Inductor fusing
#                  PyTorch's elementwise ops in place of the hand-fused kernels, the attention
#                  as kernels=auto picks it (the fused kernel as one custom op); its first
#                  step compiles (outside the profiled steps)
#   bf16-accum     zero1_bf16.json without data_types.grad_accum_dtype: gradients summed over
#                  the micro-batches in bf16 by DeepSpeedZeroOptimizer (the step checking them
#                  itself), against the shipped fp32 sums of BF16_Optimizer: what fp32 costs
#   zero2          zero2_bf16.json: ZeRO-2, fp32 gradient sums by DeepSpeedZeroOptimizer and the
#                  step's own fused gradient check, in place of BF16_Optimizer's (the
#                  candidate default if BF16_Optimizer's per-tensor checks cost the most)
#
# Each run: STEPS steps (default 30), the last 3 profiled (--profile-steps): OUT_DIR/<variant>/
# holds its summary.json, metrics.jsonl and profile (rank0.md: busy and idle per stage of the
# step); OUT_DIR/engine_sweep.md is the table of all of them. About 38 s a variant at 30 steps
# on an H200 (2026-11-26), after the fused kernels' first build. VARIANTS="name ..." runs only those; EXTRA_ARGS are
# added to every run (a rehearsal on a CPU: "--preset tiny --micro-batch-size 8 ...").
set -u -o pipefail
cd "$(dirname "$0")/.."
case ${1:-} in
    -h|--help) echo "usage: engine_sweep.sh DATA OUT_DIR  (BERT-Base engine-path variants, profiled; see its header)"
               exit 0 ;;
esac
if [[ $# -ne 2 || ${1:-} == -* ]]; then
    echo "usage: engine_sweep.sh DATA OUT_DIR" >&2
    exit 2
fi
data=$1 out=$2
python=${PYTHON:-python3}
steps=${STEPS:-30}
mkdir -p "$out"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$python" -c 'import json, sys
from bert_ds.config import resolve_ds_config_path
config = json.loads(resolve_ds_config_path("zero1_bf16.json").read_text())
overlap = json.loads(json.dumps(config))
overlap["zero_optimization"]["overlap_comm"] = True
json.dump(overlap, open(sys.argv[1] + "/zero1_bf16_overlap.json", "w"))
config.pop("data_types", None)
json.dump(config, open(sys.argv[1] + "/zero1_bf16_accum16.json", "w"))' "$scratch" || exit 2
declare -A args=(
    [base-mb256]="--micro-batch-size 256"
    [base-mb512]="--micro-batch-size 512"
    [base-mb1024]="--micro-batch-size 1024"
    [overlap]="--micro-batch-size 512 --ds-config $scratch/zero1_bf16_overlap.json"
    [torch-ops]="--micro-batch-size 512 --kernels torch"
    [compiled]="--micro-batch-size 512 --compile-layers"
    [bf16-accum]="--micro-batch-size 512 --ds-config $scratch/zero1_bf16_accum16.json"
    [zero2]="--micro-batch-size 512 --ds-config zero2_bf16.json"
)
failed=0
for variant in ${VARIANTS:-base-mb512 base-mb256 base-mb1024 overlap torch-ops compiled bf16-accum zero2}; do
    [[ -n ${args[$variant]:-} ]] || { echo "engine_sweep.sh: unknown variant $variant" >&2; exit 2; }
    echo "== $variant: ${args[$variant]}"
    run=$scratch/$variant
    # shellcheck disable=SC2086  # the variant's arguments are a list of words
    timeout --kill-after=10 "${BUDGET_S:-150}" "$python" -m bert_ds.train --data "$data" --output "$run" \
        --preset base --seq-len 128 --global-batch-size 1024 --steps "$steps" --optimizer lamb --kernels auto \
        --num-workers 4 --profile-steps "$((steps - 2))-$steps" --no-progress --no-tensorboard \
        ${args[$variant]} ${EXTRA_ARGS:-} > "$scratch/$variant.log" 2>&1
    rc=$?
    mkdir -p "$out/$variant"
    cp "$scratch/$variant.log" "$out/$variant/train.log"
    for f in summary.json metrics.jsonl profile/rank0.md profile/rank0.json; do
        [[ -f $run/$f ]] && cp "$run/$f" "$out/$variant/"
    done
    if [[ $rc -ne 0 ]]; then
        echo "== $variant FAILED (exit $rc): $(tail -1 "$scratch/$variant.log")"
        failed=$((failed + 1))
    else
        grep -E "real tokens/s|MFU" "$scratch/$variant.log"
    fi
done
"$python" -m bert_ds.tools.engine_sweep "$out" | tee "$out/engine_sweep.md"
exit "$failed"

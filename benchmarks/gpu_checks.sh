#!/usr/bin/env bash
# Every check of bert-ds that needs a GPU, in two calls of at most 6 minutes each, with the
# results of both in one folder:
#
#   benchmarks/gpu_checks.sh [--rehearse] [--call 1|2] [OUT_DIR]
#       OUT_DIR default: benchmarks/results/<gpu>-<yyyy-mm-dd> (rehearsal: <tmp>/bert-ds-rehearsal-<date>)
#   benchmarks/gpu_checks.sh --plan       each call's steps and budgets (runs nothing)
#
#   step             what                                                  budget  H100, 2026-11-27
#   call 1: what matters most
#   (start-up)       the checks, the kit's install                          15 s
#   kernels_build    python -m bert_ds.kernels.build --recheck: JIT build,   85 s    69 s
#                    self-check, kernels=auto's race at seq 128 (its verdicts)
#   test_cuda_ops    pytest tests/kernels/test_cuda_ops.py: every fused op   30 s    21 s
#                    and gradient against its reference
#   train_data       benchmarks/base_data.sh: the sample's shards in BERT's  25 s    ~6 s
#                    30,522-word vocabulary (in WORK, kept for call 2)
#   train_base       python -m bert_ds.train --preset base: the shipped      50 s    41 s (30 steps)
#                    config through the engine a user runs (ZeRO-1, bf16,
#                    LAMB, kernels=auto), micro-batch 512 at seq 128, 2
#                    accumulation steps, BASE_STEPS steps, the last 3
#                    profiled (--profile-steps): where the step goes, its
#                    host syncs
#   two_phase        python -m bert_ds.train.phases --config                 80 s    not run
#                    benchmarks/recipes/base_two_phase_check.json: phase 1
#                    at seq 128, then phase 2 at seq 512 from its weights,
#                    4 steps each, in one process: phase 2's model races
#                    kernels=auto at seq 512 there (the re-race)
#   train_base512    train_base at seq 512, phase 2 of the recipe            60 s    ~63 s
#                    (micro-batch 128, 2 a step); reads that race's verdicts
#   summary          python -m bert_ds.tools.gpu_summary: SUMMARY.md        15 s    6 s
#   call 2: ModernBERT, then BERT's variants
#   (start-up)       the checks, the kit's install                          15 s
#   modernbert_1024  python -m bert_ds.tools.bench --preset modernbert-base  60 s    not run
#                    --seq-len 1024: (a) kernels=auto, (b) torch, against
#                    transformers' ModernBertForMaskedLM with (c) SDPA and
#                    (f) flash_attention_2 (or why not), 10 timed steps,
#                    the first-batch loss check, the goal
#   modernbert_8192  the same at seq 8192                                    75 s    not run
#   train_modernbert python -m bert_ds.train --preset modernbert-base:     85 s    not run
#                    ModernBERT-base through the engine a user runs (ZeRO-1,
#                    bf16, StableAdamW, kernels=auto) at seq 1024, micro-
#                    batch 32, 2 a step, on train_data's shards (BERT's
#                    vocabulary width), BASE_STEPS steps: its MFU
#   bench            python -m bert_ds.tools.bench: (a) fused, (b) torch,    45 s    42 s (30 steps)
#                    (c) transformers at BERT-Base seq 128 and 512, 10
#                    timed steps, goals and projection
#   kernels_bench    python -m bert_ds.kernels.bench --models base: each op  45 s    64 s (and Large)
#                    against eager, compile, SDPA, varlen_attn, its roofline
#   profile          python -m bert_ds.tools.profile_step: one BERT-Base      20 s    15 s
#                    step of (a) under torch.profiler
#   summary          the same, over both calls' results                     15 s
#   in neither call (a run without --call runs them, last)
#   kernels_inspect  python -m bert_ds.kernels.inspect --summary: registers, 25 s    17 s
#                    spills, CTAs per SM as that machine's nvcc builds them
#   engine_sweep     benchmarks/engine_sweep.sh: the shipped config with    85 s    ~176 s
#                    its layers compiled, 10 steps, each split by stage
#                    (its reference, micro-batch 512 with the fused
#                    kernels, is train_base)
#   main_job         ./run.sh: the main job on the GPU (ZeRO-1 bf16, LAMB,   120 s   90 s
#                    export, fill-mask), MAIN_STEPS steps
#
# The times are the H100 run's (benchmarks/results/H100-2026-11-27, each a first build or first
# start); ~ marks a step run there in another form (train_data inside main_job; train_base512
# at micro-batch 32; engine_sweep with four other variants at 20 steps). Each call's budgets,
# its start-up included, sum to 360 s (--plan adds them up); the new forms' budgets are
# estimates from those times, not measured. A step past its budget is stopped and counted
# failed, and a call starts a step only while the time it has left (CALL_BUDGET_S, 360, less
# what it spent, less the summary's budget, held back for it) covers the step's budget.
# Left out of the calls to fit: bench (d), the layers compiled in the bench loop (BENCH_ARGS="--variants
# a,b,c,d" adds it), BERT-Large's shapes in kernels_bench, engine_sweep (BERT's layers compiled
# through the engine, and its ZeRO-2 and PyTorch-ops variants: benchmarks/engine_sweep.sh runs
# them), so that ModernBERT's two benches and its engine run fit in call 2, kernels_inspect
# (measured on an H100 and an H200), and main_job (its data build is train_data; the rest, a tiny
# model through run.sh, export and fill-mask, ran on three GPUs). ModernBERT's engine run is at
# seq 1,024 alone: its bench measures seq 8,192 (the engine at 8,192 would not fit the call).
# What did not run (not in this call, skipped for budget, a module missing) has its line in
# steps.txt and is listed in SUMMARY.md.
#
# A GPU session (the device tool's machine: 15 minutes in all, its start included, 10 a command;
# an idle machine goes back after about 30 s, so call 2 follows call 1 at once):
#   here, with internet, once:   benchmarks/gpu_kit.sh   (DeepSpeed's wheels into .gpu-kit/)
#   then two calls of the device tool's `run`, each with carry [".gpu-kit"] and timeout_s 420:
#     benchmarks/gpu_checks.sh --call 1 runs/gpu-results; s=$?; cp -r runs/gpu-results "$OUT"/; exit $s
#     benchmarks/gpu_checks.sh --call 2 runs/gpu-results; s=$?; cp -r runs/gpu-results "$OUT"/; exit $s
# The results folder (and WORK, default runs/gpu_checks: the data) sits in the ignored runs/,
# which a warm machine keeps between calls ($OUT starts empty in each), as it keeps the kernels'
# build in ~/.cache/bert-ds; so call 2 reuses both, its steps.txt keeps call 1's lines and its
# SUMMARY.md covers both calls. Copy the folder to benchmarks/results/<gpu>-<date>/ here.
#
# It runs with $PYTHON, else the project's environment ($VENV, default .venv, as run.sh
# makes it), else python3; that Python must have torch (CUDA), transformers, tokenizers,
# safetensors and numpy, and without torch the script stops at once, saying so. Wheels the
# machine lacks (DeepSpeed and its requirements; benchmarks/gpu_kit.sh downloads them) are
# installed from $KIT (default .gpu-kit) into a scratch target, without an index. Every step
# runs even if an earlier one failed; the exit status is the number of steps that failed.
# ONLY="step ..." runs only those steps of the call (a step that needs the data builds it
# first where WORK lacks it); into an OUT_DIR that holds earlier results, a run with --call
# or ONLY keeps the other steps' lines in steps.txt. BENCH_ARGS adds arguments to the model
# bench; MAIN_STEPS and BASE_STEPS set the steps of main_job and of the engine runs.
#
# --rehearse runs every step of the calls on this CPU machine: the same script, steps, result
# files and summary, at tiny shapes and a few steps (the fused ops refuse, as they do without a
# GPU; the kernel steps compile lamb.cu alone, the smallest source; the kit's wheels are
# checked to install for Python 3.12 into a scratch target), each budget and the call's
# tripled: a shared 2-core CPU starts Python, torch and DeepSpeed slower than the GPU machine
# runs BERT-Base, and more so while other work runs on it. The test suite rehearses both calls (tests/test_gpu_checks.py), so that a
# broken step, flag, writer or budget is found here and not in a GPU session.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
USAGE="gpu_checks.sh [--rehearse] [--call 1|2] [--plan] [OUT_DIR]"

# ------------------------------------------------------------------ the plan
# Each step's call ("*": both, "-": neither) and budget in seconds, in the order they run.
STARTUP_S=15  # each call's checks and the kit's install, before its first step
PLAN="
kernels_build    1   85
test_cuda_ops    1   30
train_data       1   25
train_base       1   50
two_phase        1   80
train_base512    1   60
modernbert_1024  2   60
modernbert_8192  2   75
train_modernbert 2   85
bench            2   45
kernels_bench    2   45
profile          2   20
kernels_inspect  -   25
engine_sweep     -   85
main_job         -   120
summary          *   15
"
declare -A call_of budget_of
order=()
while read -r name in_call budget; do
    [[ -n $name ]] || continue
    order+=("$name") call_of[$name]=$in_call budget_of[$name]=$budget
done <<< "$PLAN"

print_plan() {  # each call's steps and budgets, and their sum with the start-up
    local c name total
    echo "call step budget_s"
    for c in 1 2; do
        echo "$c (start-up) $STARTUP_S"
        total=$STARTUP_S
        for name in "${order[@]}"; do
            if [[ ${call_of[$name]} == "$c" || ${call_of[$name]} == '*' ]]; then
                echo "$c $name ${budget_of[$name]}"
                total=$((total + budget_of[$name]))
            fi
        done
        echo "$c (total) $total"
    done
    for name in "${order[@]}"; do
        [[ ${call_of[$name]} == - ]] && echo "- $name ${budget_of[$name]}"
    done
    return 0
}

# ------------------------------------------------------------------ the command line
rehearse=0
call=${CALL:-}  # empty: every step (both calls, then main_job), no call budget
while [[ ${1:-} == -* ]]; do
    case $1 in
        -h|--help) echo "usage: $USAGE  (every GPU check in two calls, results in OUT_DIR; see its header)"
                   exit 0 ;;
        --plan) print_plan; exit 0 ;;
        --rehearse) rehearse=1 ;;
        --call) call=${2:-}; shift ;;
        *) echo "gpu_checks.sh: unknown option $1 (usage: $USAGE)" >&2
           exit 2 ;;
    esac
    shift
done
if [[ -n $call && $call != 1 && $call != 2 ]]; then
    echo "gpu_checks.sh: --call takes 1 or 2, not '$call' (usage: $USAGE)" >&2
    exit 2
fi
# The project's environment, as run.sh finds it ($VENV, default .venv), else python3; PYTHON wins.
venv=${VENV:-.venv}
if [[ -n ${PYTHON:-} ]]; then
    python=$PYTHON
elif [[ -x $venv/bin/python ]]; then
    python=$venv/bin/python
else
    python=python3
fi
# torch, and for a GPU run the model in the device's name ("NVIDIA H100 80GB HBM3" -> H100,
# "NVIDIA A100-SXM4-80GB" -> A100), in one start of the interpreter
gpu=$("$python" -c '
import re, sys
import torch
if sys.argv[1] == "1":
    print("rehearsal")
elif torch.cuda.is_available():
    name = torch.cuda.get_device_name().removeprefix("NVIDIA ")
    print((re.search(r"\b[A-Z]+\d+\w*", name) or re.search(r"\w+", name)).group(0))' "$rehearse" 2>/dev/null)
probe=$?
if ((probe != 0)); then
    echo "gpu_checks.sh: torch does not import in $python; run ./run.sh setup (it makes $venv), or set PYTHON to a Python with torch" >&2
    exit 2
fi
echo "== python: $python"
if [[ -z $gpu ]]; then
    echo "gpu_checks.sh: no CUDA device is visible to $python" >&2
    exit 2
fi
scale=1
if ((rehearse)); then
    export DS_ACCELERATOR=cpu
    scale=3  # see the header: this CPU's start-ups, not the steps' work, set the rehearsal's times
    out=${1:-${TMPDIR:-/tmp}/bert-ds-rehearsal-$(date +%Y-%m-%d)}
    work=${WORK:-$out/.work}
else
    out=${1:-benchmarks/results/$gpu-$(date +%Y-%m-%d)}
    work=${WORK:-runs/gpu_checks}
fi
call_budget=$((scale * ${CALL_BUDGET_S:-360}))
mkdir -p "$out" "$work"
if [[ -z $call && -z ${ONLY:-} ]] || [[ ! -f $out/steps.txt ]]; then
    : > "$out/steps.txt"
fi
echo "== ${call:+call $call (budget ${call_budget}s)}${call:-every step} into $out, data in $work"
export PYTHONUNBUFFERED=1
failed=0

# ------------------------------------------------------------------ running a step
in_call() { [[ -z $call || ${call_of[$1]} == "$call" || ${call_of[$1]} == '*' ]]; }
wanted() { [[ -z ${ONLY:-} || " $ONLY " == *" $1 "* ]]; }
in_scope() { in_call "$1" && wanted "$1"; }
any_in_scope() {
    local name
    for name; do in_scope "$name" && return 0; done
    return 1
}
held_back=0  # the summary's budget, while this call runs it
in_scope summary && held_back=$((scale * budget_of[summary]))
record() {  # record NAME FIELDS...: NAME's line in steps.txt, in place of an earlier one
    local name=$1; shift
    { grep -v "^$name " "$out/steps.txt" || true; } > "$out/steps.txt.new"
    echo "$name $*" >> "$out/steps.txt.new"
    mv "$out/steps.txt.new" "$out/steps.txt"
}
not_run() {  # not_run NAME WHY: NAME did not run, and why (a step of another call keeps its line)
    local name=$1
    echo "== $name not run: $2"
    if in_scope "$name" || ! grep -q "^$name " "$out/steps.txt"; then
        record "$name" - - "$((scale * budget_of[$name]))" "$(call_now "$name")" "$2"
    fi
}
call_now() {  # the call a step runs in: this one, or (a run without --call) the plan's
    [[ -z $call ]] && echo "${call_of[$1]}" || echo "$call"
}
needs() {  # the module a step cannot run without
    case $1 in
        train_base|train_base512|two_phase|train_modernbert|engine_sweep|main_job) echo deepspeed ;;
        test_cuda_ops) echo pytest ;;
    esac
}
step() {  # step NAME COMMAND...: NAME's step, if this call runs it
    in_scope "$1" || return 0
    run_step "$@"
}
run_step() {  # run_step NAME COMMAND...: within NAME's budget, stdout+stderr kept in OUT/NAME.log
    local name=$1; shift
    local budget=$((scale * budget_of[$name])) module
    module=$(needs "$name")
    if [[ -n $module && " $missing " == *" $module "* ]]; then
        not_run "$name" "skipped: $module does not import in $python (benchmarks/gpu_kit.sh, then carry $kit)"
        return 0
    fi
    if [[ -n $call && $name != summary ]]; then  # the summary's budget is held back for it
        local left=$((call_budget - SECONDS - held_back))
        if ((left < budget)); then
            not_run "$name" "skipped for budget: its ${budget}s did not fit in the ${left}s the call had left"
            return 0
        fi
    fi
    echo "== $name (budget ${budget}s): $*"
    local start=$SECONDS
    timeout --kill-after=15 "$budget" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    record "$name" "$rc" "$((SECONDS - start))" "$budget" "$(call_now "$name")"
    if [[ $rc -ne 0 ]]; then
        [[ $rc -eq 124 || $rc -eq 137 ]] && echo "== $name ran past its ${budget}s budget"
        echo "== $name FAILED (exit $rc, $((SECONDS - start))s)"
        failed=$((failed + 1))
    else
        echo "== $name ok ($((SECONDS - start))s)"
    fi
}
list_not_run() {  # a line for each step with none in steps.txt: why it did not run
    local name why
    for name in "${order[@]}"; do
        grep -q "^$name " "$out/steps.txt" && continue
        if ! in_call "$name"; then
            case ${call_of[$name]} in
                -) why="in neither call (a run without --call runs it)" ;;
                *) why="not in this call" ;;
            esac
        elif ! wanted "$name"; then
            why="not in ONLY"
        else
            continue
        fi
        record "$name" - - "$((scale * budget_of[$name]))" "${call_of[$name]}" "$why"
    done
}

# ------------------------------------------------------------------ the carried wheels
kit=${KIT:-.gpu-kit}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
if compgen -G "$kit/*.whl" >/dev/null; then
    names=$(for wheel in "$kit"/*.whl; do basename "$wheel"; done | sed 's/-[0-9].*//' | tr '\n' ' ')
    if ((rehearse)); then  # the wheels are for the GPU machine's Python: check they install there
        if "$python" -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
            --target "$scratch/site" "$kit"/*.whl; then
            echo "== kit (rehearsal): ${names}install for Python 3.12 from $kit"
        else
            echo "== kit (rehearsal): pip cannot install $kit/*.whl for Python 3.12"; failed=$((failed + 1))
        fi
    elif ! "$python" -c 'import deepspeed' >/dev/null 2>&1; then
        if "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$scratch/site" \
            "$kit"/*.whl; then
            export PYTHONPATH="$scratch/site${PYTHONPATH:+:$PYTHONPATH}"
            echo "== kit: installed ${names}from $kit"
        else
            echo "== kit: pip could not install $kit/*.whl"
        fi
    fi
else
    echo "== kit: no wheels in $kit (benchmarks/gpu_kit.sh makes them)"
fi
missing=$("$python" -c '
import importlib.util as u
print(" ".join(m for m in ("deepspeed", "transformers", "tokenizers", "safetensors", "tensorboard", "pytest")
               if u.find_spec(m) is None))')
echo "== modules missing: ${missing:-none} (start-up: ${SECONDS}s)"

# ------------------------------------------------------------------ the steps' settings
declare -A mseq
if ((rehearse)); then
    kbench=(--device cpu --models base --tokens 256 --lamb-elements 100000 --reps 1 --no-compile)
    bench=(--device cpu --preset tiny --seq-len 64 --batch-size 8 --vocab-size 2048 --steps 2 --warmup 1 --no-probes)
    # ModernBERT's two lengths as a CPU's: both past the tiny preset's window of +-16
    mbench=(--device cpu --preset modernbert-tiny --batch-size 4 --vocab-size 2048 --steps 2 --warmup 1 --no-probes)
    mseq=([modernbert_1024]=64 [modernbert_8192]=128)
    profile=(--device cpu --preset tiny --seq-len 64 --steps 1)
    main_steps=${MAIN_STEPS:-3}
    base_steps=${BASE_STEPS:-3}
    base=(--preset tiny --seq-len 64 --micro-batch-size 8 --global-batch-size 16 --ds-config zero1_fp32.json
          --num-workers 0 --optimizer lamb)
    base512=(--preset tiny --seq-len 512 --micro-batch-size 2 --global-batch-size 4 --ds-config zero1_fp32.json
             --num-workers 0 --optimizer lamb)
    modern=(--preset modernbert-tiny --seq-len 64 --micro-batch-size 8 --global-batch-size 16
            --ds-config zero1_fp32.json --num-workers 0 --optimizer stable_adamw)
    recipe=benchmarks/recipes/tiny_two_phase_check.json
    # one variant of the GPU's list: the compiled layers (tiny, so bf16 is cheap here too)
    sweep=(STEPS=4 VARIANTS="compiled" BUDGET_S=$((scale * budget_of[engine_sweep])) EXTRA_ARGS="--preset tiny
           --seq-len 64 --micro-batch-size 8 --global-batch-size 16 --num-workers 0")
else
    kbench=(--models base)
    bench=(--steps 10 --warmup 3)
    mbench=(--preset modernbert-base --steps 10 --warmup 3)
    mseq=([modernbert_1024]=1024 [modernbert_8192]=8192)
    profile=(--preset base --seq-len 128)
    main_steps=${MAIN_STEPS:-300}
    base_steps=${BASE_STEPS:-20}
    base=(--preset base --seq-len 128 --micro-batch-size 512 --global-batch-size 1024 --ds-config zero1_bf16.json
          --num-workers 4 --optimizer lamb)
    # phase 2 of the recipe: seq 512 at its micro-batch of 128 (as many tokens as phase 1's 512), 2 a step
    base512=(--preset base --seq-len 512 --micro-batch-size 128 --global-batch-size 256 --ds-config zero1_bf16.json
             --num-workers 4 --optimizer lamb)
    # ModernBERT-base as its recipe trains it (StableAdamW), 32,768 tokens a micro-batch, 2 a step
    modern=(--preset modernbert-base --seq-len 1024 --micro-batch-size 32 --global-batch-size 64
            --ds-config zero1_bf16.json --num-workers 4 --optimizer stable_adamw)
    recipe=benchmarks/recipes/base_two_phase_check.json
    # the shipped micro-batch (512, measured as train_base) in the form not measured yet on a GPU:
    # the layers compiled (its first step compiles)
    sweep=(STEPS=10 BUDGET_S=80 VARIANTS="compiled")
fi
data=$work/data30522

# ------------------------------------------------------------------ call 1
if ((rehearse)); then  # no GPU to build for: the smallest source through nvcc (the suite compiles every one)
    step kernels_build "$python" -m bert_ds.kernels.compile_check --sources lamb.cu
else
    step kernels_build "$python" -m bert_ds.kernels.build --recheck
fi
step test_cuda_ops "$python" -m pytest -q -rs -p no:cacheprovider tests/kernels/test_cuda_ops.py
# the engine runs' data: call 1 builds it; another call reuses it, or builds it where it is missing
if in_scope train_data || { [[ ! -f $data/manifest.json ]] &&
                            any_in_scope train_base two_phase train_base512 train_modernbert engine_sweep; }
then
    run_step train_data env PYTHON="$python" benchmarks/base_data.sh "$work"
fi
runs=$scratch/runs
keep() {  # keep RUN PREFIX: a run's summary, metrics, profile and kernels' verdicts, as OUT/PREFIX_*
    local from=$1 prefix=$2 file
    for file in summary.json metrics.jsonl kernels.json profile/rank0.json profile/rank0.md; do
        local name=${file#profile/rank0}
        [[ $name == "$file" ]] && name=_$file || name=_profile$name
        cp "$from/$file" "$out/$prefix$name" 2>/dev/null || true
    done
}
engine_run() {  # engine_run NAME ARGS...: the engine path on the data, its last 3 steps profiled
    local name=$1; shift
    step "$name" "$python" -m bert_ds.train --data "$data" --output "$runs/$name" "$@" --steps "$base_steps" \
        --profile-steps "$((base_steps > 2 ? base_steps - 2 : 1))-$base_steps" --kernels auto \
        --no-progress --no-tensorboard
    keep "$runs/$name" "$name"
}
engine_run train_base "${base[@]}"
if in_scope two_phase; then  # the recipe on this call's data, into a fresh folder (a rerun would resume it)
    "$python" - "$recipe" "$data" "$runs/two_phase" > "$scratch/two_phase.json" <<'EOF'
import json, sys
plan = json.load(open(sys.argv[1]))
plan["base"]["data"]["train"], plan["output"] = [sys.argv[2]], sys.argv[3]
print(json.dumps(plan, indent=1))
EOF
fi
step two_phase "$python" -m bert_ds.train.phases --config "$scratch/two_phase.json"
for phase in "$runs"/two_phase/*/; do
    [[ -d $phase ]] && keep "$phase" "two_phase_$(basename "$phase")"
done
engine_run train_base512 "${base512[@]}"

# ------------------------------------------------------------------ call 2
for name in modernbert_1024 modernbert_8192; do
    step "$name" "$python" -m bert_ds.tools.bench --json "$out/$name.json" --markdown "$out/$name.md" \
        --seq-len "${mseq[$name]}" "${mbench[@]}"
done
engine_run train_modernbert "${modern[@]}"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of words
step bench "$python" -m bert_ds.tools.bench --json "$out/bench.json" --markdown "$out/bench.md" --variants a,b,c \
    "${bench[@]}" ${BENCH_ARGS:-}
step kernels_bench "$python" -m bert_ds.kernels.bench --json "$out/kernels_bench.json" "${kbench[@]}"
step profile "$python" -m bert_ds.tools.profile_step --json "$out/profile.json" --markdown "$out/profile.md" \
    "${profile[@]}"
if ((rehearse)); then
    step kernels_inspect "$python" -m bert_ds.kernels.inspect --summary --sources lamb.cu
else
    step kernels_inspect "$python" -m bert_ds.kernels.inspect --summary
fi

# ------------------------------------------------------------------ neither call
step engine_sweep env "${sweep[@]}" PYTHON="$python" bash benchmarks/engine_sweep.sh "$data" "$out/engine_sweep"
step main_job env VENV="$("$python" -c 'import sys; print(sys.prefix)')" SETUP=none RUN_DIR="$scratch/main" \
    STEPS="$main_steps" ./run.sh

list_not_run
step summary "$python" -m bert_ds.tools.gpu_summary "$out"
echo "== results in $out ($failed step(s) failed, ${SECONDS}s of the call's ${call_budget}s)"
exit "$failed"

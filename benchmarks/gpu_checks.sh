#!/usr/bin/env bash
# Every check of bert-ds that needs a GPU, in one command, with its results in one folder:
#
#   benchmarks/gpu_checks.sh [--rehearse] [OUT_DIR]
#       OUT_DIR default: benchmarks/results/<gpu>-<yyyy-mm-dd> (rehearsal: <tmp>/rehearsal-<date>)
#
#   step             what                                                          H100, 2026-11-27
#   kernels_build    python -m bert_ds.kernels.build --recheck: JIT build, self-check,      69 s
#                    kernels=auto's race (its verdicts)
#   kernels_inspect  python -m bert_ds.kernels.inspect --summary: registers, spills,       17 s
#                    CTAs per SM as that machine's nvcc builds them
#   test_cuda_ops    pytest tests/kernels/test_cuda_ops.py: every fused op and gradient    21 s
#                    against its reference
#   kernels_bench    python -m bert_ds.kernels.bench: each op against eager, compile,      64 s
#                    SDPA, varlen_attn, with its roofline
#   bench            python -m bert_ds.tools.bench: (a) fused, (b) torch, (c) transformers, ~42 s
#                    (d) layers compiled, at BERT-Base seq 128 and 512, goals and projection
#   profile          python -m bert_ds.tools.profile_step: one BERT-Base step of (a) under  15 s
#                    torch.profiler: busy and idle time, syncs, top kernels
#   main_job         ./run.sh: the main job on the GPU (ZeRO-1 bf16, LAMB, export,          90 s
#                    fill-mask), MAIN_STEPS steps
#   train_base       python -m bert_ds.train --preset base: the engine path a user runs     41 s
#                    (ZeRO-1, bf16, LAMB, kernels=auto), BERT's 30,522-word vocabulary,
#                    the recipe's micro-batch of 512 at seq 128, 2 accumulation steps;
#                    its last 3 steps profiled (--profile-steps): where the engine's step goes
#   train_base512    the same at seq 512, phase 2 of the recipe (micro-batch 128, 2 a step)  ~63 s
#   engine_sweep     benchmarks/engine_sweep.sh: the engine path at micro-batch 512 and   ~176 s
#                    1,024, on PyTorch's ops, with its layers compiled, on ZeRO-2; 20 steps
#                    each, each step split by stage (GPU busy and idle while the host
#                    loads, runs forward, backward, the update)
#   summary          python -m bert_ds.tools.gpu_summary: SUMMARY.md, the run in one page     6 s
#
# The times are the H100 run's (benchmarks/results/H100-2026-11-27, each a first build or
# first start; ~ marks a step run there in another form: train_base512 at micro-batch 32,
# bench without (d), engine_sweep with bf16 gradient sums in place of the compiled layers and
# without ZeRO-2).
# All steps take about 10 minutes, more than the device tool's 10 minutes a command: that
# run took two calls on one warm machine, 4 and 6.5 minutes, with the same OUT_DIR,
#   ONLY="kernels_build kernels_inspect test_cuda_ops kernels_bench bench profile summary"
#   ONLY="main_job train_base train_base512 engine_sweep summary"
# (steps.txt keeps the first call's lines; the second summary covers both). Each step is
# bounded by its budget below (a step past its budget is stopped and counted failed).
#
# It runs with $PYTHON, else the project's environment ($VENV, default .venv, as run.sh
# makes it), else python3; that Python must have torch (CUDA), transformers, tokenizers,
# safetensors and numpy, and without torch the script stops at once, saying so. Wheels the
# machine lacks (DeepSpeed and its requirements; benchmarks/gpu_kit.sh downloads them) are
# installed from $KIT (default .gpu-kit) into a scratch target, without an index. Every step
# runs even if an earlier one failed; the exit status is the number of steps that failed.
# ONLY="step ..." runs only those
# steps (train_base and engine_sweep need main_job's data); into an OUT_DIR that holds an
# earlier call's results, steps.txt keeps the other steps' lines, so a run split over two
# calls ends with one summary. BENCH_ARGS adds arguments to the model bench.
#
# --rehearse runs every step on this CPU machine: the same script, steps, result files and
# summary, at tiny shapes and a few steps (the fused ops refuse, as they do without a GPU;
# the kernel steps compile lamb.cu alone, the smallest source; the kit's wheels are checked
# to install for Python 3.12 into a scratch target). The test
# suite runs it (tests/test_gpu_checks.py), so that a broken step, flag or writer is found
# here and not in a GPU session.
set -u -o pipefail
cd "$(dirname "$0")/.."
# The project's environment, as run.sh finds it ($VENV, default .venv), else python3; PYTHON wins.
venv=${VENV:-.venv}
if [[ -n ${PYTHON:-} ]]; then
    python=$PYTHON
elif [[ -x $venv/bin/python ]]; then
    python=$venv/bin/python
else
    python=python3
fi
rehearse=0
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    echo "usage: gpu_checks.sh [--rehearse] [OUT_DIR]  (every GPU check, results in OUT_DIR; see its header)"
    exit 0
fi
if [[ ${1:-} == --rehearse ]]; then
    rehearse=1
    shift
fi
if [[ ${1:-} == -* ]]; then
    echo "gpu_checks.sh: unknown option $1 (usage: gpu_checks.sh [--rehearse] [OUT_DIR])" >&2
    exit 2
fi
if ! "$python" -c 'import torch' >/dev/null 2>&1; then
    echo "gpu_checks.sh: torch does not import in $python; run ./run.sh setup (it makes $venv), or set PYTHON to a Python with torch" >&2
    exit 2
fi
echo "== python: $python"
if ((rehearse)); then
    gpu=rehearsal
    export DS_ACCELERATOR=cpu
else
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
fi
if ((rehearse)); then
    out=${1:-${TMPDIR:-/tmp}/bert-ds-rehearsal-$(date +%Y-%m-%d)}
else
    out=${1:-benchmarks/results/$gpu-$(date +%Y-%m-%d)}
fi
mkdir -p "$out"
if [[ -n ${ONLY:-} && -f $out/steps.txt ]]; then
    # a run split over calls (ONLY, the same OUT_DIR): the other steps' lines stay, these are rerun
    awk -v only=" $ONLY " 'index(only, " " $1 " ") == 0' "$out/steps.txt" > "$out/steps.txt.kept"
    mv "$out/steps.txt.kept" "$out/steps.txt"
else
    : > "$out/steps.txt"
fi
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
    echo "$name $rc $((SECONDS - start)) $budget" >> "$out/steps.txt"
    if [[ $rc -ne 0 ]]; then
        [[ $rc -eq 124 || $rc -eq 137 ]] && echo "== $name ran past its ${budget}s budget"
        echo "== $name FAILED (exit $rc, $((SECONDS - start))s)"
        failed=$((failed + 1))
    else
        echo "== $name ok ($((SECONDS - start))s)"
    fi
}

# ------------------------------------------------------------------ the carried wheels
kit=${KIT:-.gpu-kit}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
if compgen -G "$kit/*.whl" >/dev/null; then
    names=$(cd "$kit" && ls -- *.whl | sed 's/-[0-9].*//' | tr '\n' ' ')
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
echo "== modules missing: ${missing:-none}"

# ------------------------------------------------------------------ the steps
if ((rehearse)); then
    kbench=(--device cpu --models base --tokens 256 --lamb-elements 100000 --reps 1 --no-compile)
    # (d) compiles for a minute of this CPU: tests/bert_ds/test_bench.py runs it, the sweep's compiled here
    bench=(--device cpu --preset tiny --seq-len 64 --batch-size 8 --vocab-size 2048 --steps 2 --warmup 1 --no-probes
           --variants a,b,c)
    profile=(--device cpu --preset tiny --seq-len 64 --steps 1)
    main_steps=${MAIN_STEPS:-3}
    base_steps=${BASE_STEPS:-3}
    base=(--preset tiny --seq-len 64 --micro-batch-size 8 --global-batch-size 16 --ds-config zero1_fp32.json
          --num-workers 0)
    base512=(--preset tiny --seq-len 512 --micro-batch-size 2 --global-batch-size 4 --ds-config zero1_fp32.json
             --num-workers 0)
    # one variant of the GPU's list: the compiled layers (tiny, so bf16 is cheap here too)
    sweep=(STEPS=4 VARIANTS="compiled" EXTRA_ARGS="--preset tiny --seq-len 64 --micro-batch-size 8
           --global-batch-size 16 --num-workers 0")
else
    kbench=()
    bench=()
    profile=(--preset base --seq-len 128)
    main_steps=${MAIN_STEPS:-300}
    base_steps=${BASE_STEPS:-30}
    base=(--preset base --seq-len 128 --micro-batch-size 512 --global-batch-size 1024 --ds-config zero1_bf16.json
          --num-workers 4)
    # phase 2 of the recipe: seq 512 at its micro-batch of 128 (as many tokens as phase 1's 512), 2 a step
    base512=(--preset base --seq-len 512 --micro-batch-size 128 --global-batch-size 256 --ds-config zero1_bf16.json
             --num-workers 4)
    # the shipped micro-batch (512) and its variants; overlap_comm and micro-batch 256 were
    # settled on the H200 of 2026-11-26, bf16 gradient sums on it and the H100 of 2026-11-27
    sweep=(STEPS=20 BUDGET_S=100 VARIANTS="base-mb512 base-mb1024 torch-ops compiled zero2")
fi
if ((rehearse)); then  # no GPU to build for: the smallest source through nvcc (the suite compiles every one)
    step kernels_build 240 "$python" -m bert_ds.kernels.compile_check --sources lamb.cu
    step kernels_inspect 120 "$python" -m bert_ds.kernels.inspect --summary --sources lamb.cu
else
    step kernels_build 240 "$python" -m bert_ds.kernels.build --recheck
    step kernels_inspect 120 "$python" -m bert_ds.kernels.inspect --summary
fi
step test_cuda_ops 240 "$python" -m pytest -q -rs -p no:cacheprovider tests/kernels/test_cuda_ops.py
step kernels_bench 240 "$python" -m bert_ds.kernels.bench --json "$out/kernels_bench.json" "${kbench[@]}"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of words
step bench 360 "$python" -m bert_ds.tools.bench --json "$out/bench.json" --markdown "$out/bench.md" --variants a,b,c,d \
    "${bench[@]}" \
    ${BENCH_ARGS:-}
step profile 180 "$python" -m bert_ds.tools.profile_step --json "$out/profile.json" --markdown "$out/profile.md" \
    "${profile[@]}"
if [[ " $missing " == *" deepspeed "* ]]; then
    echo "== main_job, train_base skipped: DeepSpeed does not import in $python (benchmarks/gpu_kit.sh, then carry $kit)"
else
    run_dir=$scratch/run
    step main_job 360 env VENV="$("$python" -c 'import sys; print(sys.prefix)')" SETUP=none RUN_DIR="$run_dir" \
        STEPS="$main_steps" ./run.sh
    # BERT-Base's decoder is as wide as its vocabulary: the main job's 4,096 WordPieces padded to
    # BERT's 30,522 with [unusedN] entries, as BERT's own vocabulary holds 994 of them.
    if { wanted train_base || wanted train_base512 || wanted engine_sweep; } && [[ -f $run_dir/data/train/vocab.txt ]]; then
        mkdir -p "$scratch/vocab30522"
        have=$(wc -l < "$run_dir/data/train/vocab.txt")
        { cat "$run_dir/data/train/vocab.txt"; seq 0 $((30522 - have - 1)) | sed 's/.*/[unused&]/'; } \
            > "$scratch/vocab30522/vocab.txt"
        "$python" -m bert_ds.data_tools build --input data_tools/sample/valid.txt --output "$run_dir/data30522" \
            --vocab "$scratch/vocab30522/vocab.txt" --split-sentences --workers 4 > "$out/train_base_data.log" 2>&1 \
            || echo "== train_base: its data failed to build (train_base_data.log)"
    fi
    engine_run() {  # engine_run NAME BUDGET ARGS...: the engine path on data30522, its last 3 steps profiled
        local name=$1 budget=$2; shift 2
        step "$name" "$budget" "$python" -m bert_ds.train --data "$run_dir/data30522" --output "$run_dir/$name" \
            "$@" --steps "$base_steps" --profile-steps "$((base_steps > 2 ? base_steps - 2 : 1))-$base_steps" \
            --optimizer lamb --kernels auto --no-progress --no-tensorboard
        cp "$run_dir/$name/summary.json" "$out/${name}_summary.json" 2>/dev/null || true
        cp "$run_dir/$name/metrics.jsonl" "$out/${name}_metrics.jsonl" 2>/dev/null || true
        cp "$run_dir/$name/profile/rank0.json" "$out/${name}_profile.json" 2>/dev/null || true
        cp "$run_dir/$name/profile/rank0.md" "$out/${name}_profile.md" 2>/dev/null || true
    }
    engine_run train_base 300 "${base[@]}"
    engine_run train_base512 240 "${base512[@]}"
    step engine_sweep 420 env "${sweep[@]}" PYTHON="$python" bash benchmarks/engine_sweep.sh "$run_dir/data30522" \
        "$out/engine_sweep"
fi
step summary 60 "$python" -m bert_ds.tools.gpu_summary "$out"
echo "== results in $out ($failed step(s) failed)"
exit "$failed"

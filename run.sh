#!/usr/bin/env bash
# bert-ds launcher: every user-facing mode in one place.
#
#   ./run.sh                 the main job on the bundled sample corpus: train a WordPiece
#                            vocabulary, build token shards, pretrain a small BERT (MLM + NSP)
#                            through DeepSpeed (ZeRO-1, bf16; fp32 on a CPU without bf16), export a Hugging Face directory,
#                            load it back and run a fill-mask example.
#   ./run.sh test [ARGS]     the test suite (pytest ARGS), on TEST_WORKERS processes (default: one per
#                            core, at most one per 3 GiB free and 8; -n 0 in ARGS runs it in one); first
#                            installs transformers 4 beside the environment, for the exports' check under it
#   ./run.sh test-lowest [ARGS]  the suite's torch-, transformers- and DeepSpeed-facing tests (marked lowest) under
#                            the lowest supported torch and transformers (pyproject.toml's lower bounds),
#                            in a second environment, $LOWEST_VENV (CI's second pass)
#   ./run.sh test-newest [ARGS]  the same tests under the newest releases inside pyproject.toml's ranges
#                            (as of the day its environment, $NEWEST_VENV, is made: CI's third pass)
#   ./run.sh setup           only create the environment (and build DeepSpeed's JIT ops into it)
#   ./run.sh setup-lowest    only create test-lowest's environment; setup-newest: test-newest's
#   ./run.sh lock            update requirements.lock (the versions setup installs) from pyproject.toml's
#                            ranges: the newest releases inside them, resolved with $TORCH_SPEC
#   ./run.sh prepare         sample corpus -> $DATA_DIR/{train,heldout} shards
#   ./run.sh pretrain [ARGS] python -m bert_ds.train on $DATA_DIR; ARGS override the defaults
#                            (a --data in ARGS replaces $DATA_DIR's train and heldout folders).
#                            One node: NGPU processes via torchrun --standalone (one plain process
#                            when NGPU is 1). Several nodes: run the same command on every node with
#                            NNODES and MASTER_ADDR set; torchrun's c10d rendezvous at
#                            MASTER_ADDR:MASTER_PORT gives each node its rank (the SLURM recipe in the
#                            README does exactly this). With NODE_RANK also set, the ranks are fixed
#                            instead (static rendezvous; MASTER_ADDR must be node 0).
#   ./run.sh multinode [ARGS] the same training through the deepspeed launcher on the hosts listed
#                            in $HOSTFILE ("hostname slots=GPUS" per line). Run it once, on the first
#                            host: it starts the others over passwordless ssh (pdsh), so the repo and
#                            $VENV must be at the same path on every host. Without ssh, run it on
#                            every host with NODE_RANK=0,1,... set (deepspeed --no_ssh).
#   ./run.sh export [CKPT] [OUT]  checkpoint folder -> Hugging Face directory
#   ./run.sh bench [ARGS]    python -m bert_ds.tools.bench: training throughput of bert_ds vs transformers
#   ./run.sh plot [RUN] [ARGS]  python -m bert_ds.tools.plot: loss/accuracy curves of a run as a PNG
#   ./run.sh docs [ARGS]     docs/ as a static site in site/ (mkdocs build --strict; ARGS to mkdocs build)
#
# Environment (defaults in brackets):
#   RUN_DIR    [runs/sample]        where shards, checkpoints, metrics and the export go
#   PRESET     [tiny-h128]          model preset: tiny, tiny-h128, mini, base, large
#   STEPS      [2200]               optimizer steps of the main job
#   LR         [1e-2]               peak learning rate (LAMB); WARMUP [100] its linear warm-up steps
#   DROPOUT    [0]                  hidden dropout (the presets' 0.1 only slows a run this short)
#   VOCAB_SIZE [4096]               WordPiece vocabulary trained by prepare
#   NGPU       [all visible GPUs, or 1 process on CPU]  processes on this node
#   NNODES     [1]                  pretrain: nodes in the job (> 1: multi-node rendezvous)
#   NODE_RANK  [unset]              pretrain: fixed rank of this node; multinode: launch without ssh as this node
#   MASTER_ADDR [pretrain: required when NNODES > 1; multinode: the first host of $HOSTFILE]  address of node 0
#   MASTER_PORT [29500]             port of the rendezvous on MASTER_ADDR
#   RDZV_ID    [bert-ds]            pretrain with NNODES > 1 and no NODE_RANK: the job's rendezvous id
#   HOSTFILE   [hostfile]           multinode: the deepspeed hostfile
#   VENV       [.venv]              the environment the first run creates
#   LOWEST_VENV [.venv-lowest]      test-lowest's environment; NEWEST_VENV [.venv-newest] test-newest's
#   TRANSFORMERS4_DIR [.venv-transformers4]  transformers 4 for `test` (requirements-transformers4.txt)
#   UV_SPEC    [uv==0.13.9]         the installer of those environments (pip where it does not install)
#                                   and the resolver of ./run.sh lock
#   SETUP      [auto]               auto: create or update $VENV as below; none: use $VENV/bin/python as it
#                                   is (an environment a cluster image or CI provides)
#   TORCH_SPEC [torch==2.13.0]      torch to install when none (or none in the supported range) is importable;
#                                   ./run.sh lock resolves the lock with it
#   TORCH_INDEX_URL [unset]         pip index for torch (e.g. the CPU-only wheel index)
#
# Set-up: the first run creates $VENV and installs requirements.lock into it: every dependency
# at the version CI tested, hash-checked. If python3 can already import a supported torch (a GPU
# container, a system install, NGC with apex) the environment inherits it instead of
# downloading another; otherwise $TORCH_SPEC is installed. Reruns reinstall only when
# pyproject.toml, requirements.lock or run.sh change.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$ROOT"
VENV=${VENV:-$ROOT/.venv}
SYS_PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
UV_SPEC=${UV_SPEC:-uv==0.13.9}
RUN_DIR=${RUN_DIR:-runs/sample}
DATA_DIR=$RUN_DIR/data
PRESET=${PRESET:-tiny-h128}
STEPS=${STEPS:-2200}

log() { printf '[run.sh] %s\n' "$*" >&2; }

# The project's install builds it in the checkout (setuptools writes bert_ds.egg-info there), so
# two set-ups of one checkout at once (CI makes both environments together) take turns.
one_build_at_a_time() {
    if command -v flock >/dev/null; then flock "$ROOT/pyproject.toml" "$@"; else "$@"; fi
}

setup_env() {
    [[ "${SETUP:-auto}" == none ]] && return
    local stamp="$VENV/.bert-ds-installed" want
    want=$(cat pyproject.toml requirements.lock run.sh | sha256sum | cut -d' ' -f1)
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        return
    fi
    # a lock made from other ranges would leave out what pyproject.toml added: one line, before anything
    "$SYS_PYTHON" -m bert_ds.tools.lock --check || exit 2
    if [[ ! -x "$VENV/bin/python" ]]; then
        if "$SYS_PYTHON" -c 'import torch' 2>/dev/null; then
            log "using the torch already installed for $SYS_PYTHON"
            "$SYS_PYTHON" -m venv --system-site-packages "$VENV"
        else
            "$SYS_PYTHON" -m venv "$VENV"
        fi
    fi
    local pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
    log "installing the locked dependencies (requirements.lock)"
    # --no-deps: the lock is the whole set but torch, so pip resolves nothing and fetches nothing else
    "${pip[@]}" --require-hashes --no-deps -r requirements.lock
    if ! torch_supported; then
        log "installing $TORCH_SPEC"
        "${pip[@]}" "$TORCH_SPEC" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    fi
    log "installing bert-ds"
    # with the locked setuptools, not a newest one fetched into an isolated build environment
    one_build_at_a_time "${pip[@]}" --no-deps --no-build-isolation -e .
    # DeepSpeed's JIT-built ops (on CPU its shared-memory op, 35-50 s) are built now, into
    # $VENV/torch_extensions, rather than at the first training start.
    log "building DeepSpeed's extensions"
    (export_accelerator && python_ -m bert_ds.train.extensions)
    echo "$want" > "$stamp"
}

# Whether $VENV imports a torch inside pyproject.toml's range (an inherited one may be older or
# newer); one outside it is named, and $TORCH_SPEC goes into $VENV, ahead of it.
torch_supported() {
    python_ - <<'PY'
import sys, tomllib
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement
deps = [Requirement(d) for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]]
supported = next(d.specifier for d in deps if d.name == "torch")
try:
    found = version("torch")
except PackageNotFoundError:
    sys.exit(1)
if not supported.contains(found, prereleases=True):
    print(f"[run.sh] the inherited torch {found} is outside the supported range ({supported})", file=sys.stderr)
    sys.exit(1)
PY
}

python_() { "$VENV/bin/python" "$@"; }

# The suite's worker processes (pytest-xdist): one per core, at most one per 3 GiB of free
# memory (a worker's training runs hold up to ~2 GiB) and at most 8; TEST_WORKERS overrides,
# and a -n in ARGS wins over both.
test_workers() {
    if [[ -n "${TEST_WORKERS:-}" ]]; then echo "$TEST_WORKERS"; return; fi
    local cores mem_gib n
    cores=$(nproc 2>/dev/null || echo 1)
    mem_gib=$(awk '/^MemAvailable:/ {print int($2 / 1048576)}' /proc/meminfo 2>/dev/null || echo 3)
    n=$cores
    (( mem_gib / 3 < n )) && n=$(( mem_gib / 3 ))
    (( n > 8 )) && n=8
    (( n < 1 )) && n=1
    echo "$n"
}

# The environments of test-lowest and test-newest: pyproject.toml's requirements, not the lock's
# versions, resolved by uv from PyPI: `lowest` pins torch and transformers at their lower bounds
# (the rest as uv resolves it), `newest` takes the newest release inside every range, as of the
# day the environment is made (the day is part of its stamp). Their torch is PyPI's CUDA build
# (about 5 GB installed); it runs on a CPU as well. Sets SIDE_PYTHON.
setup_side_env() {
    local which=$1 venv pins="" key stamp want
    if [[ $which == lowest ]]; then
        venv=${LOWEST_VENV:-$ROOT/.venv-lowest}
        pins=$("$SYS_PYTHON" - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(" ".join(f"{name}=={m.group(1)}" for name in ("torch", "transformers") for d in deps
               if (m := re.fullmatch(rf"{name}>=([\w.]+)(,.*)?", d))))
PY
)
        key=$pins
    else
        venv=${NEWEST_VENV:-$ROOT/.venv-newest}
        key=$(date -u +%F)
    fi
    stamp="$venv/.bert-ds-installed"
    want=$(printf '%s\n' "$key" | cat pyproject.toml run.sh - | sha256sum | cut -d' ' -f1)
    if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
        [[ -x "$venv/bin/python" ]] || "$SYS_PYTHON" -m venv "$venv"
        log "installing the $which supported releases${pins:+ ($pins)} into $venv"
        # uv, where it installs: PyPI's torch is the CUDA build (about 5 GB), which uv fetches and
        # unpacks in parallel: 63 s against pip's 192 s from empty caches (2-core machine,
        # 2026-11-28). --compile-bytecode: pip's default, which uv leaves out; without it, a
        # machine with PYTHONDONTWRITEBYTECODE set compiles torch at every import. The project
        # alone first, then its dependencies as pyproject.toml lists them: the project's build
        # (one_build_at_a_time) is then seconds long. --upgrade: a rerun resolves anew.
        local uv=("$venv/bin/python" -m uv pip install --quiet --python "$venv/bin/python" --compile-bytecode)
        # shellcheck disable=SC2086  # pins is a list of words
        if "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$UV_SPEC" 2>/dev/null; then
            one_build_at_a_time "${uv[@]}" --no-deps -e .
            "${uv[@]}" --upgrade $pins -r pyproject.toml --extra test
        else
            one_build_at_a_time "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade \
                $pins -e ".[test]"
        fi
        (VENV=$venv; export_accelerator && python_ -m bert_ds.train.extensions)
        echo "$want" > "$stamp"
    fi
    SIDE_PYTHON=$venv/bin/python
    log "$which: $("$SIDE_PYTHON" -c 'from importlib.metadata import version as v
print(", ".join(f"{n} {v(n)}" for n in ("torch", "transformers", "deepspeed", "tokenizers", "accelerate", "datasets", "numpy")))')"
}

# transformers 4 beside .venv, for the suite's check that exports read the same under it
# (tests/bert_ds/test_transformers4.py, which finds it through BERT_DS_TRANSFORMERS4): the hashed pins
# of requirements-transformers4.txt installed with pip --target, run with .venv's Python and torch.
setup_transformers4() {
    local dir=${TRANSFORMERS4_DIR:-$ROOT/.venv-transformers4} want
    want=$(sha256sum requirements-transformers4.txt | cut -d' ' -f1)
    if [[ ! -f "$dir/.bert-ds-installed" || "$(cat "$dir/.bert-ds-installed")" != "$want" ]]; then
        if [[ -e "$dir" && ! -f "$dir/.bert-ds-installed" ]]; then
            echo "run.sh: $dir exists and was not made by run.sh; move it away or set TRANSFORMERS4_DIR" >&2
            exit 2
        fi
        log "installing transformers 4 for the suite (requirements-transformers4.txt) into $dir"
        rm -rf "$dir"
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps \
            --target "$dir" -r requirements-transformers4.txt
        echo "$want" > "$dir/.bert-ds-installed"
    fi
    export BERT_DS_TRANSFORMERS4=$dir
}

# The suite's torch-, transformers- and DeepSpeed-facing tests (marked lowest) in a side environment.
test_side() {
    setup_side_env "$1"
    shift
    VENV=$(dirname "$(dirname "$SIDE_PYTHON")") export_accelerator
    # only the files that mark tests: collecting the rest would import them all for nothing
    mapfile -t marked < <(grep -rl --include='test_*.py' 'pytest.mark.lowest' tests | sort)
    "$SIDE_PYTHON" -m pytest -n "$(test_workers)" --dist worksteal -m lowest "${marked[@]}" "$@"
}

# requirements.lock anew from pyproject.toml's ranges, resolved by uv (UV_SPEC, in a throwaway
# environment: the lock must be makeable where $VENV is not, or is out of date).
lock() {
    local tools
    tools=$(mktemp -d)
    # shellcheck disable=SC2064  # the folder's name now: $tools is local, gone by the time EXIT runs
    trap "rm -rf '$tools'" EXIT
    "$SYS_PYTHON" -m venv "$tools"
    "$tools/bin/python" -m pip install --quiet --disable-pip-version-check "$UV_SPEC"
    "$tools/bin/python" -m bert_ds.tools.lock --torch "$TORCH_SPEC" "$@"
}

# A count from the environment (NGPU, NNODES) as a whole number >= 1, else one line and exit 2:
# bash arithmetic would read a word as a variable name.
count() {
    if [[ ! "$2" =~ ^[1-9][0-9]*$ ]]; then
        echo "run.sh: $1 must be a whole number >= 1, got '$2'" >&2
        exit 2
    fi
    echo "$2"
}

# The CUDA devices the environment's torch sees (0 on a CPU-only machine or torch build),
# asked once per environment: importing torch takes seconds.
probe_cuda() {
    if [[ ${CUDA_PROBED_VENV:-} != "$VENV" ]]; then
        CUDA_DEVICES=$(python_ -c 'import torch; print(torch.cuda.device_count())')
        CUDA_PROBED_VENV=$VENV
    fi
}

# Processes per node: all visible GPUs, else one CPU process (gloo).
nproc_per_node() {
    if [[ -n "${NGPU:-}" ]]; then count NGPU "$NGPU"; return; fi
    probe_cuda
    echo $(( CUDA_DEVICES > 1 ? CUDA_DEVICES : 1 ))
}

# DeepSpeed has no CPU kernels of its own to build; tell it which accelerator to use
# so it does not probe for CUDA on CPU-only machines.
export_accelerator() {
    probe_cuda
    if (( CUDA_DEVICES == 0 )); then
        export DS_ACCELERATOR=cpu
    fi
}

prepare() {
    local src=data_tools/sample
    python_ -m bert_ds.data_tools build --input "$src/valid.txt" --output "$DATA_DIR/train" \
        --train-vocab "${VOCAB_SIZE:-4096}" --split-sentences --workers 2
    python_ -m bert_ds.data_tools build --input "$src/test.txt" --output "$DATA_DIR/heldout" \
        --vocab "$DATA_DIR/train/vocab.txt" --split-sentences --workers 2
}

# On a CPU without bf16 instructions python -m bert_ds.train picks fp32 itself (zero1_fp32.json;
# a --ds-config in ARGS wins), and says so.
# ARGS that name the training data (the user's shards) take no validation set of the sample's:
# theirs is --val-data, if any.
train_args() {
    local data=(--data "$DATA_DIR/train" --val-data "$DATA_DIR/heldout")
    gives_data "$@" && data=()
    TRAIN_ARGS=(${data[@]+"${data[@]}"} --output "$RUN_DIR/train"
        --preset "$PRESET" --steps "$STEPS" --lr "${LR:-1e-2}" --warmup-steps "${WARMUP:-100}" --dropout "${DROPOUT:-0}"
        "$@")
}

gives_data() { [[ " $* " == *" --data "* || " $* " == *" --data="* ]]; }

pretrain() {
    local n nnodes
    nnodes=$(count NNODES "${NNODES:-1}")
    export_accelerator  # here, not in nproc_per_node's subshell, so that both use one probe
    n=$(nproc_per_node)
    if [[ ! -e "$DATA_DIR/train" ]] && ! gives_data "$@"; then
        echo "run.sh: no shards in $DATA_DIR/train: make them with ./run.sh prepare (RUN_DIR=$RUN_DIR), or give --data" >&2
        exit 2
    fi
    train_args "$@"
    if [[ "$nnodes" -gt 1 && -n "${NODE_RANK:-}" ]]; then
        python_ -m torch.distributed.run --nnodes "$nnodes" --node-rank "$NODE_RANK" --nproc-per-node "$n" \
            --master-addr "${MASTER_ADDR:?MASTER_ADDR must name node 0 when NNODES > 1}" --master-port "${MASTER_PORT:-29500}" \
            -m bert_ds.train "${TRAIN_ARGS[@]}"
    elif [[ "$nnodes" -gt 1 ]]; then
        python_ -m torch.distributed.run --nnodes "$nnodes" --nproc-per-node "$n" --rdzv-backend c10d \
            --rdzv-endpoint "${MASTER_ADDR:?MASTER_ADDR must name node 0 when NNODES > 1}:${MASTER_PORT:-29500}" \
            --rdzv-id "${RDZV_ID:-bert-ds}" -m bert_ds.train "${TRAIN_ARGS[@]}"
    elif [[ "$n" -gt 1 ]]; then
        python_ -m torch.distributed.run --standalone --nproc-per-node "$n" -m bert_ds.train "${TRAIN_ARGS[@]}"
    else
        python_ -m bert_ds.train "${TRAIN_ARGS[@]}"
    fi
}

multinode() {
    local hostfile=${HOSTFILE:-hostfile}
    if [[ ! -f "$hostfile" ]]; then
        echo "run.sh: multinode needs a deepspeed hostfile ('hostname slots=GPUS' per line): $hostfile not found (set HOSTFILE)" >&2
        exit 2
    fi
    export_accelerator
    train_args "$@"
    local launcher=(--hostfile "$hostfile" --master_port "${MASTER_PORT:-29500}")
    [[ -n "${MASTER_ADDR:-}" ]] && launcher+=(--master_addr "$MASTER_ADDR")
    [[ -n "${NODE_RANK:-}" ]] && launcher+=(--no_ssh --node_rank "$NODE_RANK")
    python_ -m deepspeed.launcher.runner "${launcher[@]}" --module bert_ds.train "${TRAIN_ARGS[@]}"
}

export_hf() {
    python_ -m bert_ds.checkpoint.export "${1:-$RUN_DIR/train/checkpoints/latest}" "${2:-$RUN_DIR/hf}"
}

mode=${1:-main}
[[ $# -gt 0 ]] && shift
case "$mode" in
    setup) setup_env ;;
    setup-lowest) setup_side_env lowest ;;
    setup-newest) setup_side_env newest ;;
    test)
        setup_env
        setup_transformers4
        export_accelerator
        python_ -m pytest -n "$(test_workers)" --dist worksteal "$@" ;;
    test-lowest) test_side lowest "$@" ;;
    test-newest) test_side newest "$@" ;;
    lock) lock "$@" ;;
    prepare) setup_env; prepare ;;
    pretrain) setup_env; pretrain "$@" ;;
    multinode) setup_env; multinode "$@" ;;
    export) setup_env; export_hf "$@" ;;
    bench) setup_env; export_accelerator; python_ -m bert_ds.tools.bench "$@" ;;
    plot) setup_env; python_ -m bert_ds.tools.plot "${1:-$RUN_DIR/train}" "${@:2}" ;;
    docs) setup_env; python_ -m mkdocs build --strict "$@" && log "the site is in site/ (open site/index.html)" ;;
    main)
        setup_env
        prepare
        pretrain
        export_hf
        python_ -m bert_ds.tools.demo "$RUN_DIR" ;;
    -h|--help|help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' ;;
    *) echo "run.sh: unknown mode '$mode' (modes: main, test, test-lowest, test-newest, setup, setup-lowest, setup-newest, lock, prepare, pretrain, multinode, export, bench, plot, docs; see ./run.sh --help)" >&2; exit 2 ;;
esac

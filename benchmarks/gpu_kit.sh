#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, downloaded here for its Python, into one ignored folder:
#
#   benchmarks/gpu_kit.sh [KIT_DIR]     (default: .gpu-kit, ignored by git)
#
# The GPU machine (the device tool's KINDS.md lists its packages) has Python 3.12, torch
# 2.11+cu130, transformers, tokenizers, safetensors, numpy, tensorboard, tqdm, pytest and
# ninja, and no internet: DeepSpeed and the requirements of it that the image lacks, and
# liger-kernel (a candidate of the race), travel as wheels with the working tree (at most 64
# MiB per call, the tree included), named in the call's `carry`. `benchmarks/gpu_checks.sh` installs them from KIT_DIR with
# `pip install --no-index --target` and says what it installed.
#
# Not `python -m bert_ds.tools.bundle`: that gathers everything bert-ds needs (transformers,
# datasets, pyarrow and the rest: far over the carry limit), most of which the image has.
#
# The versions are pinned to the set that ran on an H100 on 2026-11-24
# (benchmarks/results/H100-2026-11-24). DeepSpeed is published as source only; its wheel is
# built here without compiled ops (DS_BUILD_OPS=0: pure Python, ops are JIT-built where used).
set -euo pipefail
cd "$(dirname "$0")/.."
case ${1:-} in
    -h|--help) echo "usage: gpu_kit.sh [KIT_DIR]  (the wheels a lent GPU machine lacks, default .gpu-kit)"; exit 0 ;;
    -*) echo "gpu_kit.sh: unknown option $1 (usage: gpu_kit.sh [KIT_DIR])" >&2; exit 2 ;;
esac
kit=${1:-.gpu-kit}
python=${PYTHON:-python3}
target_python=${KIT_PYTHON:-3.12}
DEEPSPEED=deepspeed==0.19.8
# liger-kernel (pure Python over the image's Triton): a kernels=auto candidate of GeGLU and LayerNorm
WHEELS=(hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0 liger-kernel==0.8.5)
LIMIT_MIB=64

mkdir -p "$kit"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$target_python" \
    --implementation cp "${platforms[@]}" -d "$kit" "${WHEELS[@]}"
if ! compgen -G "$kit/deepspeed-*.whl" >/dev/null; then
    # Named from the index, not as a downloaded file: pip then reuses the wheel it built when it
    # installed this DeepSpeed here (./run.sh setup), a 30 s build otherwise. Built without ops,
    # that wheel is pure Python (py3-none-any); one with compiled ops would be tagged for this
    # machine's Python and useless on the GPU's, so it is built again without the cache.
    DS_BUILD_OPS=0 "$python" -m pip wheel --quiet --no-deps -w "$kit" "$DEEPSPEED"
    if ! compgen -G "$kit/deepspeed-*-py3-none-any.whl" >/dev/null; then
        rm -f "$kit"/deepspeed-*.whl
        DS_BUILD_OPS=0 "$python" -m pip wheel --quiet --no-deps --no-cache-dir -w "$kit" "$DEEPSPEED"
    fi
fi

# What travels: tracked and untracked-not-ignored files, plus the kit.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
kit_bytes=$(du -cb "$kit"/*.whl | tail -1 | cut -f1)
total_mib=$(( (tree_bytes + kit_bytes) / 1048576 ))
awk -v n="$(ls "$kit"/*.whl | wc -l)" -v kit="$kit" -v k="$kit_bytes" -v t="$tree_bytes" -v limit="$LIMIT_MIB" \
    'BEGIN { printf "gpu kit: %d wheels in %s, %.1f MiB; with the working tree (%.1f MiB) %.1f MiB of the %d MiB a call carries\n", n, kit, k / 1048576, t / 1048576, (k + t) / 1048576, limit }'
if (( total_mib * 2 > LIMIT_MIB )); then
    echo "gpu kit: more than half the carry limit; a call may not fit" >&2
    exit 1
fi

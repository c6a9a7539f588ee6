#!/usr/bin/env bash
# The sample corpus as token shards in BERT's vocabulary width, for the engine runs of
# benchmarks/gpu_checks.sh (train_base, train_base512, two_phase, engine_sweep):
#
#   benchmarks/base_data.sh DIR      -> DIR/data30522 (DIR/data4096 holds its vocabulary's source)
#
# A WordPiece vocabulary of 4,096 trained on data_tools/sample/valid.txt, as ./run.sh prepare
# trains it, padded to BERT's 30,522 with [unusedN] entries (BERT's own vocabulary holds 994
# of them), so that BERT-Base's decoder is as wide as BERT's; then the same text in it. A DIR
# that already holds the finished shards is left as it is: the second call of a GPU session
# reuses the first's. It runs with $PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
case ${1:-} in
    -h|--help) echo "usage: base_data.sh DIR  (the sample's shards in a 30,522-word vocabulary: DIR/data30522)"
               exit 0 ;;
esac
if [[ $# -ne 1 || $1 == -* ]]; then
    echo "usage: base_data.sh DIR" >&2
    exit 2
fi
dir=$1
python=${PYTHON:-python3}
if [[ -f $dir/data30522/manifest.json ]]; then  # the manifest is written last: the build finished
    echo "base_data.sh: $dir/data30522 is there already (reused)"
    exit 0
fi
sample=data_tools/sample/valid.txt
"$python" -m bert_ds.data_tools build --input "$sample" --output "$dir/data4096" --train-vocab 4096 \
    --split-sentences --workers 4 --no-progress
have=$(wc -l < "$dir/data4096/vocab.txt")
mkdir -p "$dir/vocab30522"
{ cat "$dir/data4096/vocab.txt"; seq 0 $((30522 - have - 1)) | sed 's/.*/[unused&]/'; } > "$dir/vocab30522/vocab.txt"
"$python" -m bert_ds.data_tools build --input "$sample" --output "$dir/data30522" --vocab "$dir/vocab30522/vocab.txt" \
    --split-sentences --workers 4 --no-progress

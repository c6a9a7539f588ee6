#!/usr/bin/env bash
set -u
o=/tmp/o; mkdir -p $o
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
python3 -m bert_ds.kernels.build > $o/kbuild.log 2>&1 &
python3 -m bert_ds.data_tools build --input data_tools/sample/valid.txt --output /tmp/d --train-vocab 4096 --split-sentences --workers 8 > $o/data.log 2>&1 || tail -3 $o/data.log
wait
run() { local name=$1; shift; timeout 150 python3 -m bert_ds.train --data /tmp/d --output $o/$name --preset base --seq-len 128 --steps 40 --no-progress --no-tensorboard "$@" > $o/$name.log 2>&1; echo "$name rc=$? $*"; python3 scratch/summ.py $o/$name; }
run base --micro-batch-size 64 --global-batch-size 64
run w4 --micro-batch-size 64 --global-batch-size 64 --num-workers 4
run m128 --micro-batch-size 128 --global-batch-size 128 --num-workers 4
run adamw --micro-batch-size 128 --global-batch-size 128 --num-workers 4 --optimizer adamw
run z0 --micro-batch-size 128 --global-batch-size 128 --num-workers 4 --ds-config zero0_bf16.json
run torch --micro-batch-size 128 --global-batch-size 128 --num-workers 4 --kernels torch
tar czf $OUT/probe.tgz -C /tmp o --exclude='*/checkpoints'

#!/usr/bin/env bash
# One lease call: the libstdc++ fix checked, then where a step's time goes.
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
r=/tmp/rc; mkdir -p $r
timeout 200 python3 -m bert_ds.kernels.build > $r/kernels_build.log 2>&1; echo "build rc=$?"
for v in a b c; do timeout 120 python3 -m bert_ds.tools.profile_step --variant $v --markdown $r/profile_base128_$v.md --json $r/profile_base128_$v.json $([ $v = a ] && echo --trace $r/trace_base128_a.json) > /dev/null 2>$r/profile_base128_$v.err || tail -5 $r/profile_base128_$v.err; done; gzip $r/trace_base128_a.json; ls -la $r
timeout 120 python3 -m bert_ds.tools.profile_step --variant a --seq-len 512 --markdown $r/profile_base512_a.md --json $r/profile_base512_a.json > /dev/null 2>$r/profile_base512_a.err || tail -5 $r/profile_base512_a.err
tar czf $OUT/resC.tgz -C /tmp rc
for f in $r/profile_*.md; do head -7 $f; done

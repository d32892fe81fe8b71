#!/usr/bin/env bash
# run101: the reranker's pool through 8 workers, 25 and 50 unseen pairs, this tree (after) against
# .ab/before (its engine/, pipelines/ and tests/; the bench script is this tree's), alternating, varlen attention.
set -u
root=$PWD
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$root/.bundle/tokgz PYTHONUNBUFFERED=1
{ date -u; cat COMMIT; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } | tee $OUT/machine.txt
n=0
for arm in before after before after; do
  n=$((n + 1)); tree=$root/.ab/$arm; [ $arm = after ] && tree=$root
  echo "== $n $arm" | tee -a $OUT/bench.log
  (cd $tree && PYTHONPATH=$root python3 -m bench.gpu_rerank --corpus $root/.bench-data/docstrings.parquet --attention varlen \
    --arms ours --pairs 25,50 --repeats 60 --out /tmp/rerank-$n 2>&1 | grep -v "Writing\|Loading" | tail -4 | tee -a $OUT/bench.log)
  cp /tmp/rerank-$n/results.json $OUT/$n-$arm.json
done

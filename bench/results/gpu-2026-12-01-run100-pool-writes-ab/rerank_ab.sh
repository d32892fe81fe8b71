#!/usr/bin/env bash
# run100: bench.gpu_rerank from three trees, the tree committed before them first and last:
# before (.ab/before), spin (this tree: chunks written by the submitting thread, pulled answers polled for),
# nospin (.ab/nospin: this tree without the polling in pull()).
set -u
root=$PWD
mkdir -p /tmp/site && tar -xJf .bundle/site.tar.xz -C /tmp/site && gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$root/.bundle/tokgz PYTHONUNBUFFERED=1
{ date -u; cat COMMIT; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__)"; } | tee $OUT/machine.txt
n=0
for arm in before spin nospin before; do
  n=$((n + 1)); tree=$root/.ab/$arm; [ $arm = spin ] && tree=$root
  echo "== $n $arm" | tee -a $OUT/bench.log
  (cd $tree && PYTHONPATH=/tmp/site:$tree python3 -m bench.gpu_rerank --corpus $root/.bench-data/docstrings.parquet \
     --repeats 40 --out /tmp/rerank-$n 2>&1 | grep -v "Writing\|Loading" | tee -a $OUT/bench.log)
  cp /tmp/rerank-$n/results.json $OUT/$n-$arm.json
done

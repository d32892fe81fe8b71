# run92: gpu_rerank as committed (0c2db19: the pulled pool from 16 pairs, in process below), and the same
# with PAIR_GROUP 1 (the first groups of one pair each, in process and through the workers).
set -u
root=$PWD
mkdir -p /tmp/site && tar -xJf .bundle/site.tar.xz -C /tmp/site; gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$root/.bundle/tokgz PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$root
for group in 2 1; do
  timeout 250 python3 -c "
import runpy, sys, pipelines.score as s
s.PAIR_GROUP = $group
sys.argv = ['gpu_rerank', '--corpus', '.bench-data/docstrings.parquet', '--repeats', '60', '--out', '$OUT/gpu_rerank_group$group']
runpy.run_module('bench.gpu_rerank', run_name='__main__')" 2>&1 | grep -v "Writing\|flashinfer.jit" | tail -7
done

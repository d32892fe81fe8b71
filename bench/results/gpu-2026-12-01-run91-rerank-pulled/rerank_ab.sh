# run91: the pulled pool (answers read by pair_scores) against reader threads (e8b18a0), both with POOL_MIN_PAIRS 2 so that
# "ours" goes through the 8 workers at 5 pairs too; "ours_in_process" beside each.
set -u
root=$PWD
mkdir -p /tmp/site && tar -xJf .bundle/site.tar.xz -C /tmp/site; gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$root/.bundle/tokgz PYTHONUNBUFFERED=1


for arm in pulled:$root before:$root/.ab/before; do
  name=${arm%%:*}; dir=${arm#*:}
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 280 python3 -c "
import runpy, sys, pipelines.score as s
s.POOL_MIN_PAIRS = 2
sys.argv = ['gpu_rerank', '--corpus', '$root/.bench-data/docstrings.parquet', '--repeats', '60', '--out', '$OUT/gpu_rerank_$name']
runpy.run_module('bench.gpu_rerank', run_name='__main__')" 2>&1 | grep -v "Writing\|flashinfer.jit" | tail -9)
done

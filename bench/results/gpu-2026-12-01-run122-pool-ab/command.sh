# run122: run121's A/B again (pool_ab.py; it stopped at 512 tokens, past MiniLM's default max length, now raised
# to 512 as bench.gpu_engine does): pool_normalize against engine.pooling's torch ops, one engine each, alternating.
set -u
out=${OUT:-bench-out}
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/minilm
{ date -u; cat COMMIT; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$out/machine.txt"
PYTHONPATH=$PWD python3 .ab/pool_ab.py "$out" .bench-data/docstrings.parquet 2>&1 | grep -v "Warn\|shards" | tee -a "$out/bench.log"

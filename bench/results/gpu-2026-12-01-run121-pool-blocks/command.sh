# run121: pool_normalize with its block chosen by rows per slot (8,192 elements over 4 warps up to 64 rows a slot,
# 32,768 over 8 past that, from run120's table): its GPU tests, the pooling table, then in one process the kernel
# against engine.pooling's torch ops on one engine each, alternating rounds (pool_ab.py): batch-1 latency and
# model-only tokens/s of MiniLM (real weights) and BERT-base (random, mean pooling).
set -u
out=${OUT:-bench-out}
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/minilm
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py -k 'pool or garbage or replay'" "bench.kernels --repeats 30 --only pooling"
PYTHONPATH=$PWD python3 .ab/pool_ab.py "$out" .bench-data/docstrings.parquet 2>&1 | grep -v Warn | tail -14 | tee -a "$out/bench.log"

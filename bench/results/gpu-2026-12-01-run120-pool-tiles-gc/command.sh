# run120: pool_normalize with its sums kept per row until the end (run119's reduced every block, 40 us for one
# 512-token sequence): the pooling table again, then in one process the kernel against engine.pooling's torch ops,
# alternating (pool_ab.py), and the GPU tests (with the collector kept out of captures, which run119 showed failing one).
set -u
out=${OUT:-bench-out}
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_qwen3.py -k 'not flashinfer and (test_gpu or 06b or triton)'" "bench.kernels --repeats 30 --only pooling"
PYTHONPATH=$PWD python3 .ab/pool_ab.py "$out" .bench-data/docstrings.parquet 2>&1 | grep -v Warn | tail -12 | tee -a "$out/bench.log"

# run119: pool_normalize (engine.triton_kernels), pooling and normalisation in one kernel: its GPU tests and
# the engine's GPU tests through it, the kernel against the torch ops, then MiniLM's throughput and batch-1
# latency (triton attention) with it.
set -u
out=${OUT:-bench-out}
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_qwen3.py -k 'not flashinfer and (pool or matryoshka or replay or real_minilm or bucket or lane or 06b or triton)'" \
  "bench.kernels --repeats 30 --only pooling"
python3 -m bench.gpu_engine --minilm .bundle/minilm --models minilm --attention triton \
  --corpus .bench-data/docstrings.parquet --suites latency,throughput --no-peers --repeats 100 \
  --out "$out/gpu_engine" 2>&1 | tail -25 | tee -a "$out/bench.log"
rm -f "$out/gpu_engine/saturation.png"
echo "== before (00e8e39, torch pooling)" | tee -a "$out/bench.log"
(cd .ab/before && python3 -m bench.gpu_engine --minilm ../../.bundle/minilm --models minilm --attention triton \
  --corpus ../../.bench-data/docstrings.parquet --suites latency,throughput --no-peers --repeats 100 \
  --out "$out/gpu_engine_before" 2>&1 | tail -25 | tee -a "$out/bench.log")
rm -f "$out/gpu_engine_before/saturation.png"

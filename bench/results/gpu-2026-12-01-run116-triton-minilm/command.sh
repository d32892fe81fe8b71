# run116: the Triton ragged attention with the real MiniLM (head_dim 32, where auto now takes it): every GPU test
# of test_gpu.py (FlashInfer's skipped, not carried), the kernel table with batch-1 BERT-base shapes and 32-row
# tiles added, and MiniLM's batch-1 latency and model-only / end-to-end throughput, varlen against triton.
set -u
out=${OUT:-bench-out}
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py" "bench.kernels --repeats 30 --only attention_triton"
python3 -m bench.gpu_engine --minilm .bundle/minilm --models minilm --attention varlen,triton \
  --corpus .bench-data/docstrings.parquet --suites latency,throughput --no-peers --repeats 200 \
  --out "$out/gpu_engine" 2>&1 | tail -40 | tee -a "$out/bench.log"
rm -f "$out/kernels/results.json" "$out/gpu_engine/saturation.png"  # about 8 files come back from a call

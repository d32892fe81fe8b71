# run147: engine/small_batch.py (two Triton kernels a BERT layer for batches of up to 64 tokens) on the H200:
# the GPU tests, then the batch-1 A/B against fe9614b's engine (per-operation layers) with a profile, then
# issue 3's latency suite with the peers, auto (small batches fused) beside triton (per-operation layers).
cp .ab/exp147.sh "$OUT/command.sh"
timeout 560 bench/run_on_gpu.sh "tests/test_gpu.py tests/test_serve.py -m gpu tests/test_qwen3.py" \
  "bench.step_latency --minilm .bundle/minilm --models minilm,bert-base --arms fused=.,per_operation=.ab/fe9614b --rounds 2 --repeats 300 --profile" \
  "bench.gpu_engine --minilm .bundle/minilm --corpus sample_data/corpus/part-000.parquet --suites latency --attention auto,triton --repeats 300"

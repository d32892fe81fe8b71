# run111: ebe2d13 (a step's lane stream made current without torch.cuda.stream's context; staging views kept):
# every GPU test but FlashInfer's (not carried: its tests ran in run112), the batch-1 A/B against 85ab06b's engine (bench.step_latency), and the
# latency and graphs suites with the peers.
set -u
out=${OUT:-bench-out}
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_qwen3.py" \
  "bench.step_latency --minilm .bundle/minilm --arms lean=.,before=.ab/85ab06b --models minilm,bert-base --repeats 300" \
  "bench.gpu_engine --minilm .bundle/minilm --corpus sample_data/corpus/part-000.parquet --suites latency,graphs --repeats 300"
ls -la "$out" "$out"/*/

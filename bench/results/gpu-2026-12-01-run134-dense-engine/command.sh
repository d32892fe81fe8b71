# run134: this session's engine changes on the H200: Dense modules after the pooling (the pooling kernel then only
# pools; Dense in float32, then the cut and normalisation, inside the graph), the forward's restructured pooling
# branch, the model files read as sentence-transformers reads them; every GPU test of test_gpu.py, test_qwen3.py
# and test_serve.py (FlashInfer's not carried), then batch 1 and model-only throughput for MiniLM (no peers) to
# see that the restructured forward costs nothing against run128 and run132.
set -u
cp .ab/exp134.sh "$OUT/command.sh"
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_qwen3.py tests/test_serve.py" \
  "bench.gpu_engine --minilm .bundle/minilm --corpus .bench-data/docstrings.parquet --models minilm --suites latency,throughput --repeats 200 --no-peers"

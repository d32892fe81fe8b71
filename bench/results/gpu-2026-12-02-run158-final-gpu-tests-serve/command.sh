#!/usr/bin/env bash
# run158: the GPU tests on the session's final code (model loading: truncate_dim, causal-LM pooling, refusals;
# tokenization without stripping; serve: /health after engine failures, the head limits as fixed after run157, /rerank
# by the model's similarity), then issue 4's suites beside the peer on that server.
set -u
out=${OUT:-bench-out}
cp .ab/exp158.sh "$out/command.sh"
timeout 560 bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_serve.py" \
  "bench.serve_bench --minilm .bundle/minilm --corpus .bench-data/docstrings.parquet --requests 150 --batch-requests 100"

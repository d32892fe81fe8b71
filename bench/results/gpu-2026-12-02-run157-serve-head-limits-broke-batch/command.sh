#!/usr/bin/env bash
# run157: the GPU tests on this session's serve and score changes (serve: /health after engine failures, the head
# limits of LimitedHttpToolsProtocol, /rerank by the model's similarity; score: the GPU top-k for dot, euclidean and
# manhattan), then issue 4's suites beside the peer on the server with the head limits.
set -u
out=${OUT:-bench-out}
cp .ab/exp157.sh "$out/command.sh"
timeout 560 bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_serve.py" \
  "bench.serve_bench --minilm .bundle/minilm --corpus .bench-data/docstrings.parquet --requests 150 --batch-requests 100"

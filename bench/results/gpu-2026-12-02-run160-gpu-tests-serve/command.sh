#!/usr/bin/env bash
# run160: the GPU tests on this session's code (--device checked by name in EngineConfig, torch_device relying on
# it; readers walking linked folders; serve binding before the model loads and listening once ready; serve options
# from the environment; the second of two servers to listen refused), then issue 4's suites beside the peer.
set -u
out=${OUT:-bench-out}
cp .ab/exp160.sh "$out/command.sh"
timeout 560 bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_serve.py" \
  "bench.serve_bench --minilm .bundle/minilm --corpus .bench-data/docstrings.parquet --requests 150 --batch-requests 100"

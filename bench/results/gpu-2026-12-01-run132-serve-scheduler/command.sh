# run132: the last session's unrun serve and scheduler commits (512faaa, 2a97bd6: Scheduler.cancel, close(drop_waiting),
# _next_batch waiting again; serve's cancellations) on the H200: every GPU test of test_gpu.py and test_serve.py (the
# scheduler's tests now run on the GPU engine too, and the GPU serve test), then issue 4's suites beside the peer.
set -u
cp .ab/exp132.sh "$OUT/command.sh"
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_serve.py" \
  "bench.serve_bench --minilm .bundle/minilm --corpus .bench-data/docstrings.parquet --requests 150 --batch-requests 100"

# run128: HEAD on the H200 with the real MiniLM: every GPU test of test_gpu.py (the last session's unrun
# commits: 61bf258 forward's pooling in one place, f5080c7's and 6563bf3's test edits) and the GPU serve test,
# then issue 3's latency and throughput suites for MiniLM side by side with sentence-transformers and transformers.
set -u
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_serve.py::test_a_server_on_the_gpu_answers_as_the_cpu_engine_does" \
  "bench.gpu_engine --minilm .bundle/minilm --corpus .bench-data/docstrings.parquet --models minilm --suites latency,throughput --repeats 200"

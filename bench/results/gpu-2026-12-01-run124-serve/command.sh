# run124: embedctl serve on 33dfaeb (pool_normalize; MiniLM through the Triton attention): the GPU serve test, then
# serve_bench without the peer (carry .bundle/minilm, .bench-data, .whl without the py-spy wheel, which left the call over 64 MiB).
bench/run_on_gpu.sh "tests/test_serve.py::test_a_server_on_the_gpu_answers_as_the_cpu_engine_does" \
  "bench.serve_bench --minilm .bundle/minilm --corpus .bench-data/docstrings.parquet --requests 150 --batch-requests 15 --no-peers"

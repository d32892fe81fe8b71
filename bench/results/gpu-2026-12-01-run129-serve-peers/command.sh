# run129: issue 4's suites on HEAD side by side with the peer (sentence-transformers behind a minimal FastAPI
# endpoint): 1-16 concurrent clients of short queries and 512-token documents, and 4 processes x 100 documents.
set -u
bench/run_on_gpu.sh "--version" \
  "bench.serve_bench --minilm .bundle/minilm --corpus .bench-data/docstrings.parquet --requests 150 --batch-requests 100"

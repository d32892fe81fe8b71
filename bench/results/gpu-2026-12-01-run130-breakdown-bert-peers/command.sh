# run130: where a batch-1 step's GPU time goes on HEAD (bench.kernels encoder_breakdown: MiniLM and BERT-base
# shapes, auto attention with FlashInfer installed, one 16-token query and 64 x 256 tokens, each kernel's share),
# then BERT-base's latency suite side by side with sentence-transformers and transformers (issue 3's batch-1 target).
set -u
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
bench/run_on_gpu.sh "--version" "bench.kernels --repeats 30 --only encoder_breakdown" \
  "bench.gpu_engine --minilm .bundle/tokgz --corpus .bench-data/docstrings.parquet --models bert-base --suites latency --repeats 200"

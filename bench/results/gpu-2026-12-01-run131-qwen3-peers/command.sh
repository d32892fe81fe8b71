# run131: issue 7's suites on HEAD (the Qwen3 path last measured in run58, 30-odd engine commits ago): the
# Qwen3-0.6B shape through FlashInfer, model-only tokens/s and batch-1 latency at 128 / 512 / 4,096 tokens,
# beside sentence-transformers on the same random weights.
set -u
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
bench/run_on_gpu.sh "--version" "bench.gpu_qwen3 --attention flashinfer --repeats 100 --docs 1024"

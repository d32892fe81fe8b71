# run112: ebe2d13's FlashInfer GPU tests (test_gpu.py and test_qwen3.py), which run111 could not carry beside
# MiniLM, and the 5-pair rerank on that engine (ours and the model alone).
set -u
out=${OUT:-bench-out}
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_qwen3.py -k 'flashinfer or FlashInfer or cross_encoder'" \
  "bench.gpu_rerank --corpus .bench-data/docstrings.parquet --repeats 60 --pairs 5 --arms ours,ours_model_only"

# run109: the pool and score worker tests, and the rerank suite with its peer, on 85ab06b (answers as bytes,
# pieces reverted); then .ab/step109.py: where one step's host time goes (MiniLM shape, BERT-base cross-encoder).
set -u
out=${OUT:-bench-out}
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
bench/run_on_gpu.sh "tests/test_tokenize_pool.py tests/test_score.py -k 'pool or worker or no_pairs'" "bench.gpu_rerank --corpus .bench-data/docstrings.parquet --repeats 60"
PYTHONPATH=/tmp/site:$PWD python3 .ab/step109.py "$out/step109" 2>&1 | tee "$out/step109.log" | tail -40
mv "$out/step109/"* "$out/"; rmdir "$out/step109"
ls -la "$out" "$out/gpu_rerank"

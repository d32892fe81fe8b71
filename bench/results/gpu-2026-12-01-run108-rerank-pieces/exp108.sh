# run108: the 5-pair rerank with the other four documents in pieces over 8 workers (the tree) against
# 8c0bb2c's one pair per worker and all five in pieces, alternating (.ab/pieces108.py), with timelines;
# the cross-encoder GPU tests; the pool and pieces tests on the 16-core host.
set -u
out=${OUT:-bench-out}
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
bench/run_on_gpu.sh "tests/test_gpu.py -k 'cross_encoder or bert_base or plans_kept or reuses'"
PYTHONPATH=/tmp/site:$PWD python3 .ab/pieces108.py "$out/pieces108" .bench-data/docstrings.parquet 2>&1 | tee "$out/pieces108.log" | tail -80
mv "$out/pieces108/timelines.json" "$out/timelines.json"; rmdir "$out/pieces108"
PYTHONPATH=/tmp/site python3 -m pytest -p no:cacheprovider -q tests/test_tokenize_pool.py tests/test_score.py -k 'pool or worker or no_pairs or pieces or planned' tests/test_tokenize.py 2>&1 | tail -5 | tee "$out/cpu_tests.log"
nproc; ls -la "$out"

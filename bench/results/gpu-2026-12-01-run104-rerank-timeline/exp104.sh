# run104: serve's 16-client short queries under py-spy (concurrency suite only); a 5-pair rerank's timeline
# (.ab/timeline5.py) with the first pair here and the rest in 8 workers, against one step for all five.
set -u
out=${OUT:-bench-out}
bench/run_on_gpu.sh "--version" "bench.serve_bench --minilm .bundle/minilm --corpus .bench-data/docstrings.parquet --requests 150 --no-peers --suites concurrency --profile"
PYTHONPATH=/tmp/site:$PWD EMBEDCTL_TEST_MODEL=.bundle/minilm python3 .ab/timeline5.py "$out/timeline5" .bench-data/docstrings.parquet 2>&1 | tee "$out/timeline5.log" | tail -60
mv "$out/timeline5/timelines.json" "$out/timelines.json"; rmdir "$out/timeline5"
mv "$out/serve_bench/py-spy-embedctl-query-16.txt" "$out/py-spy-query-16.txt"
mv "$out/serve_bench/results.json" "$out/serve_results.json"
rm -rf "$out/serve_bench" "$out/tests.log"
ls -la "$out"

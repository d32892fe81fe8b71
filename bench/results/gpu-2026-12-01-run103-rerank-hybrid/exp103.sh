# run103: serve's 16-client queries under py-spy; the reranker's 5 pairs with the first pair tokenized
# here while the workers take one pair each (the tree), against all five through the workers in groups
# of two (POOL_MIN_PAIRS 2, as before) and all in this process, alternating, varlen attention.
set -u
out=${OUT:-bench-out}
bench/run_on_gpu.sh "--version" "bench.serve_bench --minilm .bundle/minilm --corpus .bench-data/docstrings.parquet --requests 150 --batch-requests 100 --no-peers --profile"
export PYTHONPATH=/tmp/site:$PWD EMBEDCTL_TEST_MODEL=.bundle/minilm
rerank() {  # $1: name, $2: POOL_MIN_PAIRS
  python3 -c "import runpy, sys; import pipelines.score as s; s.POOL_MIN_PAIRS = $2; sys.argv = ['gpu_rerank'] + sys.argv[1:]; runpy.run_module('bench.gpu_rerank', run_name='__main__')" \
    --corpus .bench-data/docstrings.parquet --repeats 60 --attention varlen --pairs 5 --arms ours,ours_in_process,ours_model_only --out "$out/$1" 2>&1 | grep -v "^|" | tail -3
  cp "$out/$1/results.json" "$out/$1.json"
}
rerank hybrid1 16
rerank workers1 2
rerank hybrid2 16
rerank workers2 2

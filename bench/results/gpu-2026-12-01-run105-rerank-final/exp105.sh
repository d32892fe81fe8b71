# run105: the machine's CPU topology; how long a tokenizer worker takes to answer one pair (.ab/pool_probe.py);
# then the cross-encoder GPU tests and the rerank suite with FlashInfer and the peers, as committed.
set -u
out=${OUT:-bench-out}
mkdir -p "$out"
lscpu > "$out/lscpu.txt" 2>&1
gunzip -kf .bundle/tokgz/tokenizer.json.gz
mkdir -p /tmp/site && tar -xJf .bundle/site.tar.xz -C /tmp/site
PYTHONPATH=/tmp/site:$PWD python3 .ab/pool_probe.py .bundle/tokgz .bench-data/docstrings.parquet "$out/pool_probe.json" 2>&1 | tail -12
EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz bench/run_on_gpu.sh "tests/test_gpu.py -k 'cross_encoder or bert_base or plans_kept or reuses'" "bench.gpu_rerank --corpus .bench-data/docstrings.parquet --repeats 60"

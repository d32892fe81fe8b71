#!/usr/bin/env bash
# run80: the cross-encoder GPU tests, then rerank on unseen documents, tree / 5b94f56 / tree.
set -uo pipefail
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py -k cross_encoder" "bench.gpu_rerank --corpus .bench-data/docstrings.parquet --repeats 50"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
corpus=$PWD/.bench-data/docstrings.parquet
(cd .ab/before && python3 -m bench.gpu_rerank --corpus "$corpus" --repeats 50 --out "$OUT/gpu_rerank_before") 2>&1 | tail -8
python3 -m bench.gpu_rerank --corpus "$corpus" --repeats 50 --out "$OUT/gpu_rerank_after2" 2>&1 | tail -8

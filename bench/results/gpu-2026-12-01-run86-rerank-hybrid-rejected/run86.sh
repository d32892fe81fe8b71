#!/usr/bin/env bash
# run86: bench.gpu_rerank with the first groups tokenized here and the rest in 8 workers written inline.
set -uo pipefail
mkdir -p /tmp/site && tar -xJf .bundle/site.tar.xz -C /tmp/site
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export PYTHONPATH=/tmp/site:$PWD EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; } | tee "$OUT/machine.txt"
python3 -m bench.gpu_rerank --corpus .bench-data/docstrings.parquet --repeats 60 --out "$OUT/gpu_rerank" 2>&1 | grep -v Warning | tail -7

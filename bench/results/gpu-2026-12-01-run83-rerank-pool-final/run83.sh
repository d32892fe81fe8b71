#!/usr/bin/env bash
# run83: bench.gpu_rerank on the committed code (pool from 16 pairs).
set -uo pipefail
mkdir -p /tmp/site && tar -xJf .bundle/site.tar.xz -C /tmp/site
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export PYTHONPATH=/tmp/site:$PWD EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz PYTHONUNBUFFERED=1
{ date -u; git rev-parse --short HEAD; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; } | tee "$OUT/machine.txt"
python3 -m bench.gpu_rerank --corpus .bench-data/docstrings.parquet --repeats 100 --out "$OUT/gpu_rerank" 2>&1 | grep -v Warning | tail -9
python3 -m bench.gpu_rerank --corpus .bench-data/docstrings.parquet --repeats 100 --processes 8 --out "$OUT/gpu_rerank_8" 2>&1 | grep -v Warning | tail -7

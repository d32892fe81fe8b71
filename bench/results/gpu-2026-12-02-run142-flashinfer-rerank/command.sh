#!/usr/bin/env bash
# run142: the FlashInfer set on f59f46b (FlashInfer's plans and backends, BERT-base through each backend, the
# cross-encoder, Dense), then issue 5's ranking suite beside sentence-transformers' CrossEncoder.
set -u
out=${OUT:-bench-out}
cp .ab/exp142.sh "$out/command.sh"
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
timeout 330 bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_qwen3.py -k 'flashinfer or cross_encoder or dense or bert_base'"
echo "rc $?" >> "$out/tests.log"
export PYTHONPATH=/tmp/site  # run_on_gpu.sh unpacked flashinfer there
echo "== bench.gpu_rerank (all arms, the peer included)" | tee -a "$out/bench.log"
timeout 200 python3 -m bench.gpu_rerank --corpus .bench-data/docstrings.parquet --repeats 60 --out "$out/gpu_rerank" 2>&1 | tail -40 | tee -a "$out/bench.log"

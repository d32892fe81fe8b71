# run123: auto for BERT-base with FlashInfer installed now gives graphs of up to four sequences the Triton
# kernel (few_sequences_backend) and larger ones fa3; pooling through pool_normalize. The FlashInfer, BERT-base
# and cross-encoder GPU tests, then BERT-base batch-1 latency and the cross-encoder's 5 / 25 / 50 pairs through
# auto (the hybrid) and through FlashInfer alone.
set -u
out=${OUT:-bench-out}
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py -k 'bert_base or cross_encoder or flashinfer or pool'"
export PYTHONPATH=/tmp/site  # run_on_gpu.sh unpacked flashinfer there
python3 -m bench.gpu_engine --minilm .bundle/tokgz --models bert-base --attention auto,flashinfer \
  --corpus .bench-data/docstrings.parquet --suites latency --no-peers --repeats 200 \
  --out "$out/gpu_engine" 2>&1 | tail -22 | tee -a "$out/bench.log"
for backend in auto flashinfer; do
  echo "== rerank $backend" | tee -a "$out/bench.log"
  python3 -m bench.gpu_rerank --corpus .bench-data/docstrings.parquet --repeats 60 --arms ours,ours_model_only \
    --attention $backend --out "$out/rerank_$backend" 2>&1 | grep "pairs:\|attention" | tee -a "$out/bench.log"
done
rm -rf "$out"/rerank_* "$out/gpu_engine/saturation.png"

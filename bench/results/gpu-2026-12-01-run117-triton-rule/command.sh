# run117: the final rule (auto: Triton for head_dim 32 and for cross-encoders; FlashInfer for other embedders where
# installed) and tiles (128 rows at head_dim 64 only from 8 slots on): the Triton and cross-encoder GPU tests, Qwen3-0.6B's
# shape through Triton, then the cross-encoder's 5 / 25 / 50 pairs through FlashInfer and through auto (Triton),
# and BERT-base batch-1 latency through each.
set -u
out=${OUT:-bench-out}
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_qwen3.py -k '(triton or cross_encoder or attention_backend) and not real_minilm'"
export PYTHONPATH=/tmp/site  # run_on_gpu.sh unpacked flashinfer there
for backend in flashinfer auto; do
  echo "== rerank $backend" | tee -a "$out/bench.log"
  python3 -m bench.gpu_rerank --corpus .bench-data/docstrings.parquet --repeats 60 --arms ours,ours_model_only \
    --attention $backend --out "$out/rerank_$backend" 2>&1 | grep "pairs:\|attention" | tee -a "$out/bench.log"
done
python3 -m bench.gpu_engine --minilm .bundle/tokgz --models bert-base --attention flashinfer,triton \
  --corpus .bench-data/docstrings.parquet --suites latency --no-peers --repeats 200 \
  --out "$out/gpu_engine" 2>&1 | tail -25 | tee -a "$out/bench.log"
rm -rf "$out"/rerank_* "$out/gpu_engine/saturation.png"  # about 8 files come back from a call

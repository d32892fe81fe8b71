# run115: ragged_attention with the tiles chosen from run114 (64 x 64, 3 stages; 128 rows at head_dim 64):
# its GPU tests, the kernel table again, then BERT-base side by side with FlashInfer (the auto backend
# before): the cross-encoder's 5 / 25 / 50 pairs in two alternating rounds, and batch-1 latency and
# model-only / end-to-end throughput on the corpus.
set -u
out=${OUT:-bench-out}
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_qwen3.py -k 'triton and not real_minilm'" \
  "bench.kernels --repeats 30 --only attention_triton"
export PYTHONPATH=/tmp/site  # run_on_gpu.sh unpacked flashinfer there
for round in 1 2; do
  for backend in flashinfer triton; do
    echo "== rerank $backend round $round" | tee -a "$out/bench.log"
    python3 -m bench.gpu_rerank --corpus .bench-data/docstrings.parquet --repeats 60 --arms ours,ours_model_only \
      --attention $backend --out "$out/rerank_${backend}_$round" 2>&1 | grep "pairs:" | tee -a "$out/bench.log"
  done
done
python3 -m bench.gpu_engine --minilm .bundle/tokgz --models bert-base --attention flashinfer,triton \
  --corpus .bench-data/docstrings.parquet --suites latency,throughput --no-peers --repeats 200 \
  --out "$out/gpu_engine" 2>&1 | tail -40 | tee -a "$out/bench.log"
rm -rf "$out"/rerank_* "$out/kernels/results.json" "$out/gpu_engine/saturation.png"  # about 8 files come back from a call

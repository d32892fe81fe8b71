# run114: the Triton ragged attention (engine.triton_kernels.ragged_attention, --attention triton) on the H200:
# its GPU tests beside varlen's and FlashInfer's, the kernel against the others per tile config, the engine's
# profiled steps with each backend, and the 5 / 25 / 50-pair rerank through triton and FlashInfer.
set -u
out=${OUT:-bench-out}
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_qwen3.py -k 'attention_backend or bert_base_shape or cross_encoder or gqa'" \
  "bench.kernels --repeats 30 --only attention_triton,triton_breakdown"
for backend in triton flashinfer; do
  python3 -m bench.gpu_rerank --corpus .bench-data/docstrings.parquet --repeats 60 --arms ours,ours_model_only \
    --attention $backend --out "$out/rerank_$backend" 2>&1 | tail -12 | tee -a "$out/bench.log"
done

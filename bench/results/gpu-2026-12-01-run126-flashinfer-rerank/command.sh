# run126: the FlashInfer set on the last session's unrun commits (61bf258 forward's pooling in one place,
# f5080c7's per-graph backend assertions and seeded pooling test, 6563bf3's tokenizing through the CPU engine),
# then issue 5's ranking suite side by side with sentence-transformers' CrossEncoder: 5 / 25 / 50 pairs of
# 512 tokens, BERT-base cross-encoder shape, auto attention (Triton for graphs of up to 4 slots, fa3 above).
set -u
out=${OUT:-bench-out}
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_qwen3.py -k 'bert_base or cross_encoder or flashinfer or pool or backend or qwen3'"
export PYTHONPATH=/tmp/site  # run_on_gpu.sh unpacked flashinfer there
echo "== bench.gpu_rerank (all arms, the peer included)" | tee -a "$out/bench.log"
python3 -m bench.gpu_rerank --corpus .bench-data/docstrings.parquet --repeats 60 --out "$out/gpu_rerank" 2>&1 | tail -40 | tee -a "$out/bench.log"

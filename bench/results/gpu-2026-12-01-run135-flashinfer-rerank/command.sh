# run135: the FlashInfer set on this session's engine (17e1992: the restructured pooling branch, Dense, the model
# files; FlashInfer's own code unchanged since run126): the GPU tests that need FlashInfer or take the cross-encoder
# and Dense paths, then issue 5's ranking suite beside sentence-transformers' CrossEncoder (5 / 25 / 50 pairs of
# 512 tokens, BERT-base cross-encoder shape, auto attention).
set -u
out=${OUT:-bench-out}
cp .ab/exp135.sh "$out/command.sh"
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_qwen3.py -k 'flashinfer or cross_encoder or dense or bert_base'"
export PYTHONPATH=/tmp/site  # run_on_gpu.sh unpacked flashinfer there
echo "== bench.gpu_rerank (all arms, the peer included)" | tee -a "$out/bench.log"
python3 -m bench.gpu_rerank --corpus .bench-data/docstrings.parquet --repeats 60 --out "$out/gpu_rerank" 2>&1 | tail -40 | tee -a "$out/bench.log"

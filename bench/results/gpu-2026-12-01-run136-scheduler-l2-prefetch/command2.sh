# run136: the scheduler's failure path through _cancel on the GPU engine (test_serve.py's GPU tests: the scheduler's
# five, the failing-batch one new, and the GPU serve test), then an experiment: BERT-base batch 1 with the next
# layer's weights prefetched into L2 (.ab/prefetch136.py, the engine's forward patched from outside).
set -u
cp .ab/exp136b.sh "$OUT/command.sh"; cp .ab/prefetch136.py "$OUT/"
# (second call: the tests passed in the first)
export PYTHONPATH=$PWD:${PYTHONPATH:-} EMBEDCTL_TEST_MODEL=$PWD/.bundle/minilm
python3 -c "import triton; print('triton', triton.__version__)" | tee -a "$OUT/bench.log"
python3 .ab/prefetch136.py "$OUT" 2>&1 | tail -60 | tee -a "$OUT/bench.log"

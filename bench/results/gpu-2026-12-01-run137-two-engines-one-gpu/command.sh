# run137: the multi-engine index path on the one H200 lent (no two-GPU machine was): the GPU index tests (GPU against
# CPU; the two-GPU CLI test skips on one GPU), then two MiniLM engines on cuda:0 fed in turn by run_index against one.
set -u
cp .ab/exp137.sh "$OUT/command.sh"; cp .ab/two_engines137.py "$OUT/"
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py -k 'two_gpus or index_on_gpu'"
export PYTHONPATH=$PWD:${PYTHONPATH:-} EMBEDCTL_TEST_MODEL=$PWD/.bundle/minilm
python3 .ab/two_engines137.py "$OUT" .bundle/minilm 2>&1 | tail -30 | tee -a "$OUT/bench.log"

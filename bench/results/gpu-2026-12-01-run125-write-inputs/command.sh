# run125: PackedBatch.write_inputs in fewer numpy calls: GPU tests of layouts (bucket boundaries, replay, the real
# MiniLM), then write_ab.py (old / new write_inputs / new with the C++ inference-mode guard, alternating).
set -u
out=${OUT:-bench-out}
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py -k 'bucket or replay or real_minilm or lane'"
PYTHONPATH=$PWD python3 .ab/write_ab.py "$out" 2>&1 | grep -v Warn | tail -4 | tee -a "$out/bench.log"

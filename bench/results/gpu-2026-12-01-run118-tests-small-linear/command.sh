# run118: the GPU tests of the last session's unrun commits (ff7dd45, f42f764: Triton attention through
# DeviceOffsetsAttention, 64-bit bases, tiles constants) with the real MiniLM; then where batch-1 time goes
# (small_linear.py, an experiment).
set -u
out=${OUT:-bench-out}
bench/run_on_gpu.sh "-m gpu tests/test_gpu.py tests/test_qwen3.py -k 'triton or attention_backend or real_minilm or bucket or replay'"
PYTHONPATH=$PWD python3 .ab/small_linear.py 2>&1 | tee "$out/small_linear.log" | tail -5

# The second call, on the same warm machine right after command.sh: the two Qwen3 tests that ran out of GPU memory
# beside five other pytest processes, alone.
export EMBEDCTL_TEST_MODEL=/tmp/minilm-random PYTHONPATH=/tmp/site; mkdir -p $OUT
timeout 200 python3 -m pytest -p no:cacheprovider -v -m gpu tests/test_qwen3.py -k "True-last-varlen or True-last-triton" 2>&1 | tail -8 | tee $OUT/qwen3_rerun.log

#!/usr/bin/env bash
# run162, third call: the index GPU test alone (the budget left allowed no more)
timeout 85 bench/run_on_gpu.sh "-m gpu tests/test_gpu.py -k 'index and not two'"

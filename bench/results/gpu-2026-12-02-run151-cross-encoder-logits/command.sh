# run151: the cross-encoder's sigmoid moved out of the graph to Engine.activate (serve's raw_scores): its GPU tests.
cp .ab/exp151.sh "$OUT/command.sh"
timeout 400 bench/run_on_gpu.sh "tests/test_gpu.py tests/test_serve.py -m gpu -k 'cross_encoder or server or bert_base or real_minilm'"

# run150: where engine/small_batch.py's kernel time goes: its last program's LayerNorm, warps, stages, 16-row tiles.
cp .ab/exp150.sh "$OUT/command.sh"; cp .ab/micro150.py "$OUT/"
for shape in minilm bert-base; do PYTHONPATH=$PWD timeout 150 python3 .ab/micro150.py "$OUT" $shape 2>&1 | grep -v Warn | tail -8; done

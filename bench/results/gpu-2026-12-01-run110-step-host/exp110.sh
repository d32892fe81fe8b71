# run110: .ab/host110.py, one step's host costs and the A/B of leaner run()/_stage() variants.
set -u
out=${OUT:-bench-out}
gunzip -kf .bundle/tokgz/tokenizer.json.gz
export EMBEDCTL_TEST_MODEL=$PWD/.bundle/tokgz
bench/run_on_gpu.sh "--version"
PYTHONPATH=/tmp/site:$PWD python3 .ab/host110.py "$out/host110" 2>&1 | tee "$out/host110.log" | grep -v Writing | tail -30
mv "$out/host110/host110.json" "$out/"; rmdir "$out/host110"; rm -f "$out/tests.log"

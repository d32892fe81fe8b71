#!/usr/bin/env bash
# Copies the committed tree (HEAD) into .snap/ (git-ignored) for a device call, so that the GPU runs
# exactly a commit even while the working tree holds edits in progress. Carry .snap with the bundles
# and run `cd .snap && bench/run_on_gpu.sh ...` there; .snap/COMMIT names the commit.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .snap && mkdir .snap
git archive HEAD | tar -x -C .snap
git rev-parse --short HEAD > .snap/COMMIT
ln -s ../.bundle .snap/.bundle
ln -s ../.bench-data .snap/.bench-data
ln -s ../.whl .snap/.whl

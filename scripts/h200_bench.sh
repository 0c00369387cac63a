#!/usr/bin/env bash
# Device call: install, then `ple-um bench` on a 16 GiB table with two processes for the memory figure.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { echo "pip failed"; cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/device.txt
PLE_UM_CACHE_DIR=/tmp/plecache timeout 560 ple-um bench --size 16GiB --repeats 40 --processes 2 \
    --json $OUT/bench_h200.json --plot $OUT/bench_h200.png --quiet 2> $OUT/bench_progress.log | tee $OUT/bench.txt
echo "bench rc=$?"; tail -3 $OUT/bench_progress.log

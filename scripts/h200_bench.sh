#!/usr/bin/env bash
# Device call: install, then `ple-um bench` on a 16 GiB table with two processes for the memory figure.
source scripts/h200_setup.sh
PLE_UM_CACHE_DIR=/tmp/plecache timeout 560 ple-um bench --size 16GiB --repeats 40 --processes 2 \
    --json-file $OUT/bench_h200.json --plot $OUT/bench_h200.png --quiet 2> $OUT/bench_progress.log | tee $OUT/bench.txt
echo "bench rc=$?"; tail -3 $OUT/bench_progress.log

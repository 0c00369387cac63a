#!/usr/bin/env bash
# Device call: the checks and bulk profile of scripts/h200_final_check.sh (core GPU checks on a 4 GiB
# table, concurrency, the bulk path at 131 072 rows by id against the planned C copy and
# index_select), then `ple-um bench` side by side.
source scripts/h200_final_check.sh
PLE_UM_CACHE_DIR=/tmp/plecache timeout 200 ple-um bench --size 16GiB --repeats 40 \
    --json-file $OUT/bench_h200.json --plot $OUT/bench_h200.png --quiet 2> $OUT/progress.log > /tmp/bench.txt
echo "bench rc=$? $(date +%T)"; sed -n '3,13p;15,22p' /tmp/bench.txt

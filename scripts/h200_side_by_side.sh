#!/usr/bin/env bash
# Device call: `ple-um bench` on a 16 GiB table, every path open at once and timed side by side:
# the full run (4 rounds, two processes for the memory figure), then the lookups again with the
# timed calls in one block per path (--rounds 1, as the bench measured before), then 4 rounds again.
source scripts/h200_setup.sh
bench() {  # name, timeout, extra args
    local name=$1 limit=$2; shift 2
    echo "== $name $(date +%T)" >> $OUT/progress.log
    PLE_UM_CACHE_DIR=/tmp/plecache timeout $limit ple-um bench --size 16GiB --repeats 40 "$@" \
        --json $OUT/$name.json --quiet 2>> $OUT/progress.log > /tmp/$name.txt
    echo "$name rc=$? $(date +%T)"
}
date +%T
bench bench_h200 300 --processes 2 --plot $OUT/bench_h200.png
cat /tmp/bench_h200.txt
bench bench_h200_rounds1 120 --rounds 1
sed -n '3,13p' /tmp/bench_h200_rounds1.txt
bench bench_h200_rounds4 120
sed -n '3,13p' /tmp/bench_h200_rounds4.txt

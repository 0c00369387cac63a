#!/usr/bin/env bash
# Device call: core GPU checks on a 4 GiB table and concurrent lookups (big batches through the bulk
# path, its rows now read by id), the bulk path at 131 072 rows by id against the planned C copy and
# index_select (scripts/profile_rowcopy.py --bulk-only), then `ple-um bench` side by side.
source scripts/h200_setup.sh
rm -f $OUT/install.log
timeout 150 python3 scripts/gpu_check.py --dir /tmp/ple-check --gib 4 --shards 64 --json $OUT/gpu_check.json > $OUT/checks.log 2>&1
echo "gpu_check rc=$? $(date +%T)"; grep -E "FAIL|passed|row reads" $OUT/checks.log | cut -c1-300
rm -rf /tmp/ple-check
timeout 80 python3 scripts/gpu_concurrency.py --dir /tmp/ple-conc --gib 2 >> $OUT/checks.log 2>&1
echo "concurrency rc=$? $(date +%T)"; grep -E "FAIL|passed" $OUT/checks.log | tail -2 | cut -c1-300
rm -rf /tmp/ple-conc
PLE_UM_CACHE_DIR=/tmp/plecache timeout 140 python3 scripts/profile_rowcopy.py --size-gib 16 --bulk-only --json $OUT/rowcopy.json > $OUT/rowcopy.txt 2>&1
echo "rowcopy rc=$? $(date +%T)"; sed -n '/^| 131072 rows/,$p' $OUT/rowcopy.txt | tail -20
PLE_UM_CACHE_DIR=/tmp/plecache timeout 200 ple-um bench --size 16GiB --repeats 40 \
    --json $OUT/bench_h200.json --plot $OUT/bench_h200.png --quiet 2> $OUT/progress.log > /tmp/bench.txt
echo "bench rc=$? $(date +%T)"; sed -n '3,13p;15,22p' /tmp/bench.txt

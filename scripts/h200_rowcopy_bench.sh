#!/usr/bin/env bash
# Device call: the C row copy against torch.index_select in the bulk path (scripts/profile_rowcopy.py),
# then `ple-um bench` on the same 16 GiB table with two processes for the memory figure.
source scripts/h200_setup.sh
PLE_UM_CACHE_DIR=/tmp/plecache timeout 180 python3 scripts/profile_rowcopy.py --size-gib 16 --json $OUT/rowcopy.json > $OUT/rowcopy.log 2>&1
echo "rowcopy rc=$?"; sed -n '/^| 131072 rows/,$p' $OUT/rowcopy.log | tail -30
PLE_UM_CACHE_DIR=/tmp/plecache timeout 390 ple-um bench --size 16GiB --repeats 40 --processes 2 \
    --json-file $OUT/bench_h200.json --plot $OUT/bench_h200.png --quiet 2> $OUT/bench_progress.log | tee $OUT/bench.txt
echo "bench rc=$?"; tail -3 $OUT/bench_progress.log

#!/usr/bin/env bash
# Device call: GPU checks, concurrent lookups on two streams, bad ids under compute-sanitizer, then
# the benchmark on a 16 GiB table.
source scripts/h200_setup.sh
timeout 200 python3 scripts/gpu_check.py --dir /tmp/ple-check --gib 8 --shards 64 --json $OUT/gpu_check.json > $OUT/gpu_check.log 2>&1
echo "gpu_check rc=$?"; grep -E "FAIL|passed|calibration" $OUT/gpu_check.log | cut -c1-400
rm -rf /tmp/ple-check
timeout 120 python3 scripts/gpu_concurrency.py --dir /tmp/ple-conc --gib 2 --json $OUT/gpu_concurrency.json > $OUT/gpu_concurrency.log 2>&1
echo "concurrency rc=$?"; grep -E "FAIL|passed" $OUT/gpu_concurrency.log | cut -c1-300
rm -rf /tmp/ple-conc
timeout 100 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 python3 scripts/gpu_sanitize.py /tmp/ple-san > $OUT/sanitize.log 2>&1
echo "sanitizer rc=$?"; grep -E "ERROR SUMMARY|all bad-id|not zero|accepted|gave" $OUT/sanitize.log | tail -3
PLE_UM_CACHE_DIR=/tmp/plecache timeout 360 ple-um bench --size 16GiB --repeats 40 --processes 2 \
    --json-file $OUT/bench_h200.json --plot $OUT/bench_h200.png --quiet 2> $OUT/bench_progress.log | tee $OUT/bench.txt
echo "bench rc=$?"

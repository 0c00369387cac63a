#!/usr/bin/env bash
# Device call: core GPU checks on a small table, concurrent lookups (threads x 2 streams), then
# where a lookup's time goes on the bench's 16 GiB table (scripts/profile_lookup.py).
source scripts/h200_setup.sh
timeout 150 python3 scripts/gpu_check.py --dir /tmp/ple-check --gib 2 --shards 64 --json $OUT/gpu_check.json > $OUT/gpu_check.log 2>&1
echo "gpu_check rc=$?"; grep -E "FAIL|passed" $OUT/gpu_check.log | cut -c1-300
timeout 150 python3 scripts/gpu_concurrency.py --dir /tmp/ple-conc --gib 2 --json $OUT/concurrency.json > $OUT/concurrency.log 2>&1
echo "concurrency rc=$?"; grep -E "^\| |passed|Error|error" $OUT/concurrency.log | cut -c1-300
PLE_UM_CACHE_DIR=/tmp/plecache timeout 290 python3 scripts/profile_lookup.py --size-gib 16 --json $OUT/profile.json > $OUT/profile.log 2>&1
echo "profile rc=$?"; sed -n '/^$/,$p' $OUT/profile.log | tail -90

#!/usr/bin/env bash
# Device call: the final code's GPU checks (core engine on a 4 GiB table, concurrency) and the bulk
# path at 131 072 rows by id / planned / index_select against the vLLM-style kernel, outputs checked.
source scripts/h200_setup.sh
rm -f $OUT/install.log
timeout 150 python3 scripts/gpu_check.py --dir /tmp/ple-check --gib 4 --shards 64 --json $OUT/gpu_check.json > $OUT/checks.log 2>&1
echo "gpu_check rc=$? $(date +%T)"; grep -E "FAIL|passed" $OUT/checks.log | cut -c1-300
rm -rf /tmp/ple-check
timeout 80 python3 scripts/gpu_concurrency.py --dir /tmp/ple-conc --gib 2 >> $OUT/checks.log 2>&1
echo "concurrency rc=$? $(date +%T)"; grep -E "FAIL|passed" $OUT/checks.log | tail -1 | cut -c1-300
rm -rf /tmp/ple-conc
PLE_UM_CACHE_DIR=/tmp/plecache timeout 150 python3 scripts/profile_rowcopy.py --size-gib 16 --bulk-only --json $OUT/rowcopy.json > $OUT/rowcopy.txt 2>&1
echo "rowcopy rc=$? $(date +%T)"; sed -n '/^| 131072 rows/,$p' $OUT/rowcopy.txt | tail -20

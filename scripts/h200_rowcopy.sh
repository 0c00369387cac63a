#!/usr/bin/env bash
# Device call: what the host is, core GPU checks on an 8 GiB table and concurrent lookups (both read big batches
# through the bulk path and its C row copy), then the row copy against torch.index_select
# (scripts/profile_rowcopy.py) on the bench's 16 GiB table.
source scripts/h200_setup.sh
# What the host is (docs/results/h200_host.txt): CPU, huge pages, the guest's IOMMUs (none listed), compilers.
{ lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|L3|NUMA node0"; grep -E "Huge|FilePmd" /proc/meminfo; uname -r;
  ls /sys/class/iommu 2>&1 | head -3; dmesg 2>/dev/null | grep -i -m5 -E "iommu|dmar"; which cc gcc; } 2>&1
timeout 200 python3 scripts/gpu_check.py --dir /tmp/ple-check --gib 8 --shards 64 --json $OUT/gpu_check.json > $OUT/gpu_check.log 2>&1
echo "gpu_check rc=$?"; grep -E "FAIL|passed|calibration|row reads" $OUT/gpu_check.log | cut -c1-400
rm -rf /tmp/ple-check
timeout 120 python3 scripts/gpu_concurrency.py --dir /tmp/ple-conc --gib 2 --json $OUT/gpu_concurrency.json > $OUT/gpu_concurrency.log 2>&1
echo "concurrency rc=$?"; grep -E "FAIL|passed" $OUT/gpu_concurrency.log | cut -c1-300
rm -rf /tmp/ple-conc
PLE_UM_CACHE_DIR=/tmp/plecache timeout 240 python3 scripts/profile_rowcopy.py --size-gib 16 --json $OUT/rowcopy.json > $OUT/rowcopy.log 2>&1
echo "rowcopy rc=$?"; sed -n '/^$/,$p' $OUT/rowcopy.log | tail -40

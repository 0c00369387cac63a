#!/usr/bin/env bash
# Device call: BF16 (8 GiB, 65 shards), F16 and NVFP4 checks, then `ple-um bench` on the NVFP4 table.
source scripts/h200_setup.sh
timeout 150 python3 scripts/gpu_check_formats.py --dir /tmp/ple-formats $FORMATS --json $OUT/gpu_check_formats.json > $OUT/gpu_check_formats.log 2>&1
echo "formats rc=$?"; grep -E "FAIL|passed|written" $OUT/gpu_check_formats.log | cut -c1-300
timeout 70 ple-um bench /tmp/ple-formats/nvfp4 --rows 16,1024,16384,131072 --repeats 10 --modes registered,cpu,device \
    --json-file $OUT/bench_nvfp4.json --quiet 2> $OUT/bench_nvfp4_progress.log | tee $OUT/bench_nvfp4.txt
echo "bench rc=$?"

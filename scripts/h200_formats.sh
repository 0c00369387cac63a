#!/usr/bin/env bash
# Device call: BF16 (8 GiB, 65 shards), F16 and NVFP4 checks, then `ple-um bench` on the NVFP4 table.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { echo "pip failed"; cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/device.txt
timeout 150 python3 scripts/gpu_check_formats.py --dir /tmp/ple-formats $FORMATS --json $OUT/gpu_check_formats.json > $OUT/gpu_check_formats.log 2>&1
echo "formats rc=$?"; grep -E "FAIL|passed|written" $OUT/gpu_check_formats.log | cut -c1-300
timeout 70 ple-um bench /tmp/ple-formats/nvfp4 --rows 16,1024,16384,131072 --repeats 10 --modes registered,cpu,device \
    --json $OUT/bench_nvfp4.json --quiet 2> $OUT/bench_nvfp4_progress.log | tee $OUT/bench_nvfp4.txt
echo "bench rc=$?"

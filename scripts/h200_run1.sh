#!/usr/bin/env bash
# One device call: install, GPU checks (core engine), then the benchmark on a 16 GiB table.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { echo "pip failed"; cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/device.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/device.txt
timeout 280 python3 scripts/gpu_check.py --dir /tmp/ple-check --gib 8 --shards 64 --json $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log | grep -v "^\[PASS\]"
rm -rf /tmp/ple-check
PLE_UM_CACHE_DIR=/tmp/plecache timeout 280 ple-um bench --size 16GiB --json $OUT/bench_h200.json --plot $OUT/bench_h200.png --quiet 2> $OUT/bench_progress.log | tee $OUT/bench.txt
echo "bench rc=$?"; tail -5 $OUT/bench_progress.log

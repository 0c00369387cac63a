#!/usr/bin/env bash
# Device call: install, GPU checks of the core engine, bad ids under compute-sanitizer memcheck.
source scripts/h200_setup.sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/device.txt
timeout 300 python3 scripts/gpu_check.py --dir /tmp/ple-check --gib 8 --shards 64 --json $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log | grep -v "^\[PASS\]"
echo "gpu_check rc=$?"
timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 python3 scripts/gpu_sanitize.py /tmp/ple-san > $OUT/sanitize.log 2>&1
echo "sanitizer rc=$?"; grep -E "ERROR SUMMARY|all bad-id|not zero|accepted|gave" $OUT/sanitize.log | tail -5

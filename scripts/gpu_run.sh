#!/usr/bin/env bash
# The one way to run ple-um's GPU checks and profiles on a CUDA host (the lent H200: the device tool
# runs commands from the repository root; no package index there). Installs ple-um from the working
# tree, then runs the parts named (default: tests profile bench), each under its own time limit,
# logs and JSON under $OUT (default ./.out), and prints a short summary last.
#
#   scripts/gpu_run.sh                       # tests, profile, bench
#   scripts/gpu_run.sh tests                 # python -m pytest -m gpu (tests/gpu)
#   SIZE=16GiB scripts/gpu_run.sh profile    # scripts/profile_host_node.py
#   SIZE=16GiB scripts/gpu_run.sh bench      # ple-um bench, side by side
#   scripts/gpu_run.sh tp                    # scripts/tp_check.py on two GPUs
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/.out}
SIZE=${SIZE:-16GiB}
mkdir -p "$OUT"
export PLE_UM_CACHE_DIR=${PLE_UM_CACHE_DIR:-/tmp/ple-um-cache}
if ! python3 -c "import ple_um.kernels" 2>/dev/null; then
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
        || { echo "pip install failed"; tail -20 "$OUT/install.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
summary=()
run() {  # run NAME LIMIT_S COMMAND...: log in $OUT/NAME.log, exit code in the summary
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    summary+=("$name rc=$rc $((SECONDS - t0))s")
    echo "== $name rc=$rc ($((SECONDS - t0)) s)"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests profile bench)
for part in "${parts[@]}"; do
    case $part in
        tests) run tests "${TESTS_LIMIT:-300}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
                   --junitxml="$OUT/gpu_tests.xml" ${PYTEST_ARGS:-} ;;
        profile) run profile "${PROFILE_LIMIT:-300}" python3 scripts/profile_host_node.py --size "$SIZE" \
                     --out "$OUT/profile_host_node.json" ${PROFILE_ARGS:-} ;;
        bench) run bench "${BENCH_LIMIT:-300}" python3 -m ple_um.cli bench --size "$SIZE" ${BENCH_ARGS:-} ;;
        tp) run tp "${TP_LIMIT:-400}" python3 scripts/tp_check.py --size "${TP_SIZE:-$SIZE}" \
                --out "$OUT/tp_check.json" ${TP_ARGS:-} ;;
        *) echo "unknown part $part (tests, profile, bench, tp)"; exit 2 ;;
    esac
done
printf '%s\n' "${summary[@]}"

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
#   scripts/gpu_run.sh guard                 # scripts/check_direct_read_guard.py (first read in a child)
#   scripts/gpu_run.sh unaligned             # scripts/check_unaligned.py (tables at odd byte offsets)
#   scripts/gpu_run.sh eager                 # scripts/profile_eager.py (an eager lookup's host time)
# The parts that need the big table (profile, bench, guard) share one: ple-um bench's synthetic table
# of $SIZE, written once into $PLE_UM_CACHE_DIR (or $TABLE, when set); tp writes its own (shaped so
# that the two ranks' vocab split falls inside a shard).
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
table() {  # the shared table's directory (written on first use)
    if [ -z "${TABLE:-}" ]; then
        TABLE=$(python3 -c "import sys; from ple_um import units; from ple_um.bench.config import Config, default_table; \
print(default_table(Config(size=units.parse_size(sys.argv[1]))))" "$SIZE" 2> "$OUT/table.log") \
            || { echo "writing the table failed"; tail "$OUT/table.log"; exit 1; }
        echo "table: $TABLE"
    fi
}
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
        tests) eval "extra=(${PYTEST_ARGS:-})"  # shell words: PYTEST_ARGS='-k "not nvfp4"' keeps its quotes
               run tests "${TESTS_LIMIT:-300}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
                   --junitxml="$OUT/gpu_tests.xml" "${extra[@]}" ;;
        profile) table; run profile "${PROFILE_LIMIT:-300}" python3 scripts/profile_host_node.py --dir "$TABLE" \
                     --size "$SIZE" --out "$OUT/profile_host_node.json" ${PROFILE_ARGS:-} ;;
        bench) table; run bench "${BENCH_LIMIT:-300}" python3 -m ple_um.cli bench --size "$SIZE" ${BENCH_ARGS:-} ;;
        tp) run tp "${TP_LIMIT:-400}" python3 scripts/tp_check.py --size "${TP_SIZE:-$SIZE}" \
                --out "$OUT/tp_check.json" ${TP_ARGS:-} ;;  # its own table: the split inside a shard
        guard) table; run guard "${GUARD_LIMIT:-300}" python3 scripts/check_direct_read_guard.py --dir "$TABLE" \
                   --size "$SIZE" --faults --json "$OUT/guard.json" ${GUARD_ARGS:-} ;;
        eager) run eager "${EAGER_LIMIT:-120}" python3 scripts/profile_eager.py --out "$OUT/profile_eager.json" ;;
        unaligned) run unaligned "${UNALIGNED_LIMIT:-300}" python3 scripts/check_unaligned.py \
                       --dir /tmp/ple-unaligned --json "$OUT/unaligned.json" ;;
        *) echo "unknown part $part (tests, profile, bench, tp, guard, unaligned, eager)"; exit 2 ;;
    esac
done
printf '%s\n' "${summary[@]}"

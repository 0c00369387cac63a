#!/usr/bin/env bash
# The one way to run ple-um's GPU tests, benchmarks and profile on a CUDA host, from the repository
# root. Installs ple-um from the working tree with no package index (its dependencies must be
# installed already), then runs the parts named (default: tests profile bench), each under its own
# time limit (NAME_LIMIT seconds), logs and JSON under $OUT (default ./.out), and prints a short
# summary last. The parts:
#
#   tests    python -m pytest -m gpu (tests/gpu: every lookup path, CUDA graphs, cold rows, tables at
#            odd byte offsets, the first-read guard, bad ids under compute-sanitizer memcheck when it
#            is on the PATH or in /usr/local/cuda/bin); PYTEST_ARGS adds pytest arguments
#   bench    ple-um bench on the shared table, side by side, its JSON in $OUT/bench.json; BENCH_ARGS
#            adds arguments
#   engram   ple-um bench --model deepseek-v41: a DeepSeek-V4.1 Engram table of $ENGRAM_SIZE (default
#            8GiB), ple-um's modes side by side with torch and vLLM's stock pinned copy; ENGRAM_ARGS
#   cold     ple-um bench --memory-limit: a table of $COLD_SIZE (default 12GiB) served by lookups
#            held to $MEMORY_LIMIT (default 3GiB) of memory, uniform and zipf:1.1 ids; COLD_ARGS
#   serving  ple-um bench --serving: a decode loop's step of $STEP_MS ms of GPU work (default 5,20,50)
#            with the step's lookups issued at its start, the whole step one CUDA graph, on a table
#            of $COLD_SIZE under $MEMORY_LIMIT and without, $SERVING_IDS ids; SERVING_ARGS
#   profile  tools/profile_cold.py on the shared table; PROFILE_ARGS adds arguments
#   regress  tools/host_cost.py on the shared table in each of $REGRESS_MODES (registered cpu) with this
#            tree and with $OLD_TREE (another build's package: `git archive REV ple_um kernels | tar -x
#            -C old`, moving a root kernels/ into old/ple_um/), alternately, $REGRESS_PAIRS (2) times
#            each, no row cache; then the two builds compared (--compare): where the table fits
#   slots    tools/slot_reads.py on the shared table: row cache hits served by the cpu mode's host path
#            against the kernel reading them from the cache's registered slots (issue 43's design b,
#            its best case); SLOTS_ARGS adds arguments
#   tp       tools/tp_check.py on two GPUs, its own table of $TP_SIZE (the two ranks' vocab split
#            inside a shard): uniform, zipf:1.1 and trace ids, early lookups on a side stream, eager
#            and in CUDA graphs, a second pass with a row cache of $TP_ROW_CACHE (default 2GiB) per
#            rank, each rank in a memory cgroup of $TP_MEMORY_LIMIT (default 10GiB: registered pins
#            half the table), and an Engram table split by heads; TP_ARGS adds arguments
#
#   tools/gpu_run.sh                       # tests, profile, bench, engram
#   SIZE=16GiB tools/gpu_run.sh bench cold
# The parts that need the big table (profile, bench) share one: ple-um bench's synthetic table of
# $SIZE, written once into $PLE_UM_CACHE_DIR (or $TABLE, when set).
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
if ! command -v compute-sanitizer > /dev/null && [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
    export PATH=$PATH:/usr/local/cuda/bin  # tests/gpu/test_gpu_memcheck.py looks for it on the PATH
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
[ ${#parts[@]} -eq 0 ] && parts=(tests profile bench engram)
for part in "${parts[@]}"; do
    case $part in
        tests) eval "extra=(${PYTEST_ARGS:-})"  # shell words: PYTEST_ARGS='-k "not nvfp4"' keeps its quotes
               run tests "${TESTS_LIMIT:-480}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
                   --junitxml="$OUT/gpu_tests.xml" "${extra[@]}" ;;
        bench) table; run bench "${BENCH_LIMIT:-300}" python3 -m ple_um.cli bench "$TABLE" \
                   --json-file "$OUT/bench.json" ${BENCH_ARGS:-} ;;
        engram) run engram "${ENGRAM_LIMIT:-400}" python3 -m ple_um.cli bench --model deepseek-v41 \
                    --size "${ENGRAM_SIZE:-8GiB}" --json-file "$OUT/engram.json" ${ENGRAM_ARGS:-} ;;
        cold) run cold "${COLD_LIMIT:-500}" python3 -m ple_um.cli bench --memory-limit "${MEMORY_LIMIT:-3GiB}" \
                  --size "${COLD_SIZE:-12GiB}" --ids uniform,zipf:1.1 --json-file "$OUT/cold.json" ${COLD_ARGS:-} ;;
        serving) run serving "${SERVING_LIMIT:-560}" python3 -m ple_um.cli bench --serving \
                     --memory-limit "${MEMORY_LIMIT:-3GiB}" --size "${COLD_SIZE:-12GiB}" \
                     --ids "${SERVING_IDS:-uniform,zipf:1.1,trace}" --step-ms "${STEP_MS:-5,20,50}" \
                     --json-file "$OUT/serving.json" --plot "$OUT/serving.png" ${SERVING_ARGS:-} ;;
        profile) table; run profile "${PROFILE_LIMIT:-300}" python3 tools/profile_cold.py --dir "$TABLE" \
                     --out "$OUT/profile_cold.json" ${PROFILE_ARGS:-} ;;
        regress) table
                 [ -d "${OLD_TREE:-}/ple_um" ] || { echo "regress: OLD_TREE must hold another build's ple_um"; exit 2; }
                 for mode in ${REGRESS_MODES:-registered cpu}; do
                     for k in $(seq "${REGRESS_PAIRS:-2}"); do
                         for build in new old; do
                             tree=$PWD; [ "$build" = old ] && tree=$(cd "$OLD_TREE" && pwd)
                             PYTHONPATH=$tree PLE_UM_ROW_CACHE=0 run "regress_${mode}_${build}$k" "${REGRESS_LIMIT:-120}" \
                                 python3 tools/host_cost.py --dir "$TABLE" --mode "$mode" \
                                 --json-file "$OUT/regress_${mode}_${build}$k.json"
                         done
                     done
                     PYTHONPATH=$PWD run "regress_$mode" 60 python3 tools/host_cost.py --compare "$OUT"/regress_"${mode}"_new*.json \
                         --against "$OUT"/regress_"${mode}"_old*.json --json-file "$OUT/regress_$mode.json"
                 done ;;
        slots) table; run slots "${SLOTS_LIMIT:-180}" python3 tools/slot_reads.py --dir "$TABLE" \
                   --json-file "$OUT/slot_reads.json" ${SLOTS_ARGS:-} ;;
        tp) run tp "${TP_LIMIT:-580}" python3 tools/tp_check.py --size "${TP_SIZE:-$SIZE}" \
                --row-cache "${TP_ROW_CACHE:-2GiB}" --memory-limit "${TP_MEMORY_LIMIT:-10GiB}" \
                --timeout $((${TP_LIMIT:-580} - 30)) \
                --out "$OUT/tp_check.json" ${TP_ARGS:-} ;;  # its own table: the split inside a shard
        *) echo "unknown part $part (tests, bench, engram, cold, serving, regress, profile, slots, tp)"; exit 2 ;;
    esac
done
printf '%s\n' "${summary[@]}"

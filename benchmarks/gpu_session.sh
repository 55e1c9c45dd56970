#!/usr/bin/env bash
# One short session on a lent GPU machine: the tests that need CUDA, then
# `make bench-gpu`'s parts, each under a time limit inside one overall deadline, so that
# whatever finished comes back. Run from the repository root:
#
#     OUT=/some/folder bash benchmarks/gpu_session.sh
#
# Writes under $OUT (7 files, nothing deeper): session.log (everything printed), env.txt
# (the machine), cuda_tests.log and cuda_tests.xml, suite.log, gpu_results.json (every table
# as it is done) and gpu.md (docs/bench/gpu.md rendered from it). Then, on the development
# machine: python benchmarks/gpu.py --render gpu_results.json > docs/bench/gpu.md
#
# Settings (environment): PYTHON (python3), GPU_SESSION_SECONDS (overall deadline, 390),
# GPU_SESSION_GB (float16 cache size, 8), GPU_SESSION_SAMPLE (seconds per loader sample, 3),
# SAEV_BENCH_DIR (where the caches go: by default the first of ./bench_out, /var/tmp, /root
# that is not a tmpfs and has room). Carried wheels in .whl/ are installed into /tmp/site
# first (orjson: the GPU image lacks it). Without CUDA every step still runs: the CUDA tests
# skip, saying so, and the benchmark measures its host parts.
set -u
START=$(date +%s)
OUT=${OUT:?set OUT to the folder for the results}
PY=${PYTHON:-python3}
DEADLINE=$((START + ${GPU_SESSION_SECONDS:-390}))
GB=${GPU_SESSION_GB:-8}
SAMPLE=${GPU_SESSION_SAMPLE:-3}
RESULTS=$OUT/gpu_results.json
LOG=$OUT/session.log
mkdir -p "$OUT"
: >"$LOG"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci SAEV_RESULTS_DIR=/tmp/saev_results

say() { echo "[gpu_session +$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
left() { echo $((DEADLINE - $(date +%s))); }
# The seconds a step may take: its own budget, cut to what the deadline leaves (less a reserve
# for the steps after it); 0 when too little is left to start it.
budget() {
    local want=$1 reserve=${2:-20} l
    l=$(($(left) - reserve))
    if ((l < 15)); then echo 0; elif ((want < l)); then echo "$want"; else echo "$l"; fi
}
mark() { "$PY" benchmarks/gpu.py --results "$RESULTS" --mark "$1" "$2" >>"$LOG" 2>&1; }

# -- wheels, the machine ----------------------------------------------------------------
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >>"$LOG" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || say "installing .whl/*.whl FAILED"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -z "${SAEV_BENCH_DIR:-}" ]; then
    for d in "$PWD/bench_out" /var/tmp/saev_bench /root/saev_bench; do
        mkdir -p "$d" 2>/dev/null || continue
        kind=$(stat -f -c %T "$d" 2>/dev/null)
        avail=$(df -Pk "$d" | awk 'NR==2 {print int($4 / 1048576)}')
        if [ "$kind" != tmpfs ] && [ "$kind" != ramfs ] && [ "${avail:-0}" -ge $((3 * ${GB%.*} + 4)) ]; then
            export SAEV_BENCH_DIR=$d
            break
        fi
    done
    export SAEV_BENCH_DIR=${SAEV_BENCH_DIR:-$PWD/bench_out}
fi
{
    echo "== date, kernel, cores, memory"; date -u; uname -a; nproc; head -5 /proc/meminfo
    echo "== GPU"; nvidia-smi 2>&1 | head -25
    nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.sm,clocks.mem \
        --format=csv 2>&1 | head -3
    echo "== Python and packages"; "$PY" --version
    "$PY" -m pip list 2>/dev/null | grep -i -E '^(numpy|torch|numba|llvmlite|ml.dtypes|xxhash|orjson|hypothesis|pytest|pytest-xdist|pytest-timeout|transformers) '
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
    echo "== benchmark folder $SAEV_BENCH_DIR"; df -hT "$SAEV_BENCH_DIR"; stat -f -c 'filesystem %T' "$SAEV_BENCH_DIR"
    echo "== drop_caches writable: $([ -w /proc/sys/vm/drop_caches ] && echo yes || echo no)"
    echo "== CPU"; lscpu 2>/dev/null | grep -E 'Model name|^CPU\(s\)|NUMA node\(s\)|Thread'
} >"$OUT/env.txt" 2>&1
say "$(grep -m1 -E 'NVIDIA|No devices|not found|failed' "$OUT/env.txt" || echo 'nvidia-smi: no answer')"
say "$(grep -m1 '^torch ' "$OUT/env.txt")"
if ! "$PY" -c "import saev_shards, saev_shards.loaders, saev_shards.dump.recorder, saev_shards.demo.sae" >>"$LOG" 2>&1; then
    say "IMPORT FAILED: saev_shards does not import under $PY (session.log has the error)"
fi
CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
DROP=()
if [ "$CUDA" = 1 ]; then DROP=(--drop-all); else say "no CUDA GPU: the CUDA tests skip, the benchmark measures its host parts"; fi
PYTEST_OPTS=(-q -p no:cacheprovider -rs)
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_OPTS+=(--timeout=120)

# -- the caches (in the background), the CUDA tests -------------------------------------
BENCH=("$PY" benchmarks/gpu.py --gb "$GB" --seconds "$SAMPLE" --keep --results "$RESULTS")
rm -f "$RESULTS"
T=$(budget 200 120)
say "writing the ${GB} GB float16 and float8 caches under $SAEV_BENCH_DIR (at most ${T}s, in the background)"
timeout -k 5 "$T" "${BENCH[@]}" --parts build >/tmp/gpu_session_build.log 2>&1 &
BUILD=$!
T=$(budget 150 150)
say "CUDA tests (at most ${T}s)"
timeout -k 5 "$T" "$PY" -m pytest "${PYTEST_OPTS[@]}" --junitxml="$OUT/cuda_tests.xml" \
    tests/unit/loaders/test_cuda.py \
    tests/unit/loaders/test_token_loader.py::test_pin_memory_pins_batches_on_a_gpu_node \
    tests/integration/test_docs_run.py -k "not test_the_block_runs_as_written or loaders.md" \
    >"$OUT/cuda_tests.log" 2>&1
TESTS_RC=$?
TESTS=$(grep -E '(passed|failed|error|skipped)' "$OUT/cuda_tests.log" | tail -1)
((TESTS_RC == 124 || TESTS_RC == 137)) && TESTS="stopped at its time limit (${T}s) after: ${TESTS:-nothing}"
say "CUDA tests: exit $TESTS_RC: $TESTS"
grep -E '^(FAILED|ERROR)' "$OUT/cuda_tests.log" | head -20 | tee -a "$LOG"
wait $BUILD
BUILD_RC=$?
cat /tmp/gpu_session_build.log >>"$LOG"
if ((BUILD_RC != 0)); then
    mark build "$( ((BUILD_RC == 124 || BUILD_RC == 137)) && echo 'stopped at its time limit' || echo "failed (exit $BUILD_RC)")"
    say "BUILD FAILED (exit $BUILD_RC): $(tail -3 /tmp/gpu_session_build.log)"
else
    say "caches written: $(grep -h 'wrote the' /tmp/gpu_session_build.log | tr '\n' ' ')"
fi
mark cuda_tests "exit $TESTS_RC: ${TESTS:-no summary line}"

# -- the benchmark, part by part ----------------------------------------------------------
run_part() {
    local part=$1 want=$2 reserve=$3 t rc
    t=$(budget "$want" "$reserve")
    if ((t == 0)); then
        say "$part: skipped, the deadline is near"
        mark "$part" "skipped: the session's deadline was near"
        return
    fi
    say "$part (at most ${t}s)"
    timeout -k 5 "$t" "${BENCH[@]}" --parts "$part" "${DROP[@]}" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    if ((rc == 124 || rc == 137)); then
        mark "$part" "stopped at its time limit (${t}s)"
        say "$part: stopped at its time limit"
    elif ((rc != 0)); then
        mark "$part" "failed (exit $rc; session.log has the traceback)"
        say "$part: FAILED (exit $rc)"
    fi
}
if ((BUILD_RC == 0)); then
    run_part limits 60 200
    run_part modes 80 150
    run_part float8 60 120
    run_part sae 75 90
    run_part cold 90 50
    run_part threads 40 40
fi

# -- the loader, recorder and float8 suites under this node's Python, numpy and torch ----
T=$(budget 100 10)
if ((T > 0)); then
    XDIST=()
    "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 8)
    say "loader, recorder and float8 tests (at most ${T}s)"
    timeout -k 5 "$T" "$PY" -m pytest "${PYTEST_OPTS[@]}" "${XDIST[@]}" tests/unit/loaders tests/unit/dump/test_recorder.py \
        tests/unit/codecs/test_float8.py tests/unit/codecs/test_float8_numba.py --ignore=tests/unit/loaders/test_cuda.py \
        >"$OUT/suite.log" 2>&1
    RC=$?
    SUITE=$(grep -E '(passed|failed|error)' "$OUT/suite.log" | tail -1)
    ((RC == 124 || RC == 137)) && SUITE="stopped at its time limit (${T}s)"
    say "suite: exit $RC: $SUITE"
    grep -E '^(FAILED|ERROR)' "$OUT/suite.log" | head -20 | tee -a "$LOG"
    mark suite "exit $RC: ${SUITE:-no summary line}"
fi

# -- docs/bench/gpu.md --------------------------------------------------------------------
if "$PY" benchmarks/gpu.py --render "$RESULTS" >"$OUT/gpu.md" 2>>"$LOG"; then
    say "rendered gpu.md; targets:"
    sed -n '/^## Targets/,$p' "$OUT/gpu.md" | tee -a "$LOG"
else
    say "render FAILED (session.log)"
fi
say "done in $(($(date +%s) - START))s; files: $(ls "$OUT" | tr '\n' ' ')"

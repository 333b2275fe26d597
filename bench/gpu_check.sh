#!/usr/bin/env bash
# make gpu-check [OUT=dir]: bench/gpu_check.py with a Python that has what it needs, built from this tree.
# - Where `python3` (or $GPU_PY) has torch with a CUDA device (a GPU node, the lent GPU machine): kvstore is built
#   there from the tree into that Python (pip, offline: no index, no build isolation; wheels of missing dependencies
#   may wait in .whl/, e.g. crc32c for the lent machine, which cannot download). If pip cannot build it (an older
#   setuptools), the native modules are compiled with cc and the tree is made importable as installed.
# - Elsewhere: the dry run in .venv (make's venv), where every GPU step reports "skipped: no CUDA".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/gpu-check}
mkdir -p "$OUT"
PY=${GPU_PY:-python3}
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu-check: CUDA in $PY; building kvstore from the tree"
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || echo "gpu-check: carried wheels not installed"
    fi
    if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/build.log" 2>&1; then
        echo "gpu-check: pip could not build kvstore (tail of $OUT/build.log below); compiling the modules with cc"
        tail -5 "$OUT/build.log"
        INC=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
        SUF=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
        for m in kvindex kvcopy; do
            cc -O2 -shared -fPIC -I"$INC" native/$m.c -o kvstore/_$m$SUF >>"$OUT/build.log" 2>&1 \
                || echo "gpu-check: native/$m.c did not build: the pure-Python fallback runs"
        done
        # kvstore.connectors and kvstore.configs are connectors/ and configs/ once installed
        [ -e kvstore/connectors ] || ln -s ../connectors kvstore/connectors
        [ -e kvstore/configs ] || ln -s ../configs kvstore/configs
    fi
else
    echo "gpu-check: no CUDA in $PY: a dry run in .venv (every GPU step is skipped)"
    make -s .venv/.installed || exit 1
    PY=.venv/bin/python
fi
"$PY" bench/gpu_check.py --out "$OUT"

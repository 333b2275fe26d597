#!/usr/bin/env bash
# Builds .venv-sglang (beside this checkout's .venv) from nothing: SGLang 0.5.23 over a CPU torch, for
# tests/connectors/test_sglang_connector.py and the Triton interpreter tests (tests/connectors/test_kv_pages.py -m triton).
# Idempotent: a stamp holding this script's digest skips a finished build; an edit of this script rebuilds. kvstore
# itself is an editable install of this checkout, redone (in seconds) when pyproject.toml or setup.py change, so its
# package-dir mapping (connectors/ as kvstore.connectors, configs/ as kvstore.configs) and entry points follow them.
# Usage: tests/setup_sglang_env.sh [VENV_DIR]   (default: <repo>/.venv-sglang)
#
# The recipe (../shared/ENGINES.md, "SGLang 0.5.23 on CPU"): pip must not resolve SGLang's own requirements (they pin
# torch 2.14.1, a CUDA build, and several GB of CUDA kernels), so CPU torch goes first, SGLang goes in with --no-deps,
# then the light dependencies its import needs, by name. PyPI's torchvision is CUDA-linked: its operators never load
# here, and its fake-op registrations for them would fail at import, so those two registrations are skipped when the
# operators are absent (an edit of the installed torchvision, inside this venv only).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-sglang}"
PY="${PY:-python3}"
STAMP="$VENV/.installed"
DIGEST="$(sha256sum "$0" | cut -d' ' -f1)"
KVSTORE_STAMP="$VENV/.kvstore"
KVSTORE_DIGEST="$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)"

install_kvstore() {   # kvstore (editable, from this checkout) and the test tools
    # one build of this tree at a time (the Makefile's venvs and wheel build it too, under make -j)
    flock "$ROOT/.kvstore-build.lock" "$VENV/bin/pip" install -q -e "$ROOT" pytest pytest-timeout pytest-asyncio
    echo "$KVSTORE_DIGEST" > "$KVSTORE_STAMP"
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$DIGEST" ]; then
    [ "$(cat "$KVSTORE_STAMP" 2>/dev/null)" = "$KVSTORE_DIGEST" ] || install_kvstore
    exit 0
fi

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q --no-compile)   # byte-compiled at the end, on every core
"${PIP[@]}" --upgrade pip

# 1. CPU torch first (on this machine's disk), so nothing later pulls a CUDA one
"${PIP[@]}" torch==2.13.0

# 2. SGLang itself, without its requirements
"${PIP[@]}" --no-deps sglang==0.5.23

# 3. what `import sglang` and its engine on CPU need, by name
"${PIP[@]}" aiohttp fastapi msgspec orjson pyzmq pydantic requests psutil packaging pillow tqdm uvicorn uvloop \
    xxhash zstandard pybase64 python-multipart partial_json_parser interegular einops distro regex setproctitle \
    scipy sentencepiece IPython dill loguru gguf openai==2.8.0 triton==3.9.0 apache-tvm-ffi==0.1.11 \
    transformers==5.19.0 tokenizers==0.23.2
"${PIP[@]}" --no-deps compressed-tensors==0.18.0 xgrammar==0.2.7 torchvision==0.28.0

# 4. torchvision without its (CUDA-linked) operators: skip the two fake-op registrations that need them
META="$("$VENV/bin/python" - <<'EOF'
import importlib.util, os
print(os.path.join(os.path.dirname(importlib.util.find_spec("torchvision").origin), "_meta_registrations.py"))
EOF
)"
sed -i -E 's/^@torch\.library\.register_fake\(("torchvision::[a-z_]+")\)$/@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))  # kvstore: no CUDA ops/' "$META"

# 5. kvstore (editable, from this checkout) and the test tools
install_kvstore

# 6. the classes the tests drive must import, and Triton (its interpreter runs the GPU copy kernel's tests here)
(cd "$ROOT" && "$VENV/bin/python" -W ignore -c "
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
import kvstore.connectors.sglang_backend
import triton
")

# 7. byte-compile on every core (pip would on one; the tests start many SGLang processes)
"$VENV/bin/python" -m compileall -qq -j 0 "$VENV/lib" || true   # 1: a few templates are not Python
echo "$DIGEST" > "$STAMP"

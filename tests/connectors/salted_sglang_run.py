"""tests/sglang_engine_run.py with SGLang's per-request `cache_salt`: `run` as there, its request under the salt in
$KVSTORE_TEST_CACHE_SALT (none when unset or empty):

    KVSTORE_TEST_CACHE_SALT=a python tests/connectors/salted_sglang_run.py run MODEL_DIR SOCKET PROMPT_LEN [...]

A shim until sglang_engine_run.py takes a salt itself: it wraps `sglang.Engine.generate`, which `run` calls once.
"""
from __future__ import annotations

import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    sys.path.insert(0, ROOT)
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from kvstore.connectors.sglang_patches import apply

    apply()
    from sglang.srt.entrypoints.engine import Engine  # the class itself: `sglang.Engine` is a lazy proxy

    from tests import sglang_engine_run

    salt = os.environ.get("KVSTORE_TEST_CACHE_SALT") or None
    plain = Engine.generate

    def generate(self: Any, *args: Any, **kw: Any) -> Any:
        return plain(self, *args, **kw, **({"cache_salt": salt} if salt else {}))

    Engine.generate = generate           # type: ignore[method-assign]
    opts = dict(zip(sys.argv[5::2], sys.argv[6::2]))
    sglang_engine_run.run(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(opts.get("--expect-blocks", 0)),
                          opts.get("--wait"))


if __name__ == "__main__":
    main()

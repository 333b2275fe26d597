"""tests/vllm_engine_run.py with vLLM's per-request `cache_salt`: each step may carry "cache_salt", which the step's
prompt gets (`TokensPrompt(prompt_token_ids=..., cache_salt=...)`). Same arguments as vllm_engine_run's `run`:

    python tests/connectors/salted_engine_run.py run --model DIR --socket PATH --steps '[{..., "cache_salt": "a"}]'

A shim until vllm_engine_run.py passes the step's salt itself: it wraps `LLM.generate`, which `run` calls once per
step with one prompt (a TokensPrompt, a dict), so that the i-th call's prompt gets the i-th step's salt.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    sys.path.insert(0, ROOT)
    from vllm import LLM

    from tests import vllm_engine_run

    steps = json.loads(sys.argv[sys.argv.index("--steps") + 1])
    salts = iter([step.get("cache_salt") for step in steps])
    plain = LLM.generate

    def generate(self: LLM, prompts: list[dict[str, Any]], *args: Any, **kw: Any) -> Any:
        salt = next(salts)
        return plain(self, [{**p, "cache_salt": salt} if salt else p for p in prompts], *args, **kw)  # type: ignore

    LLM.generate = generate              # type: ignore[method-assign,assignment]
    vllm_engine_run.main()


if __name__ == "__main__":
    main()

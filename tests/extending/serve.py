"""`python -m tests.extending.serve [tier] [policy]`: register the toy tier and/or the toy eviction policy, as a
deployment's own code would, then run `kvstore serve` (its configuration from the environment, as usual)."""
from __future__ import annotations

import sys

from kvstore.cli import main
from kvstore.policy import register as register_policy
from kvstore.tiers.registry import Entry
from kvstore.tiers.registry import register as register_tier

if __name__ == "__main__":
    if "tier" in sys.argv[1:]:
        register_tier("toy", Entry("tests.extending.toy_tier", "tests.extending.toy_tier:ToyConfig"))
    if "policy" in sys.argv[1:]:
        register_policy("fifo", "tests.extending.toy_policy")
    sys.exit(main(["serve"]))

#!/usr/bin/env bash
# `make stress`'s hostile suite (issue 29): every attack of a neighbour — pins and reservations against a tenant's
# floor, admin and secrets, hint floods, shared queues, metrics — run ROUNDS times while two busy loops load the CPUs,
# so that no defence holds only because the attacker was slow. Usage: tests/hostile_stress.sh PYTHON [ROUNDS]
set -euo pipefail
py=${1:?python}
rounds=${2:-3}
pids=()
for _ in 1 2; do (while :; do :; done) & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
for r in $(seq "$rounds"); do
    echo "hostile suite, round $r of $rounds (two busy loops)"
    "$py" -m pytest -q tests/daemon/test_hostile.py tests/daemon/test_isolation.py tests/daemon/test_hostile_hints.py \
        tests/daemon/test_limits.py tests/daemon/test_quotas.py \
        tests/daemon/test_metrics_exposure.py tests/daemon/test_tenants.py tests/index/test_reclaim.py \
        tests/tiers/test_ssd_staging_tenants.py tests/movers/test_fair.py
done

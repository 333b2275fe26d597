"""`make gpu-check` (bench/gpu_check.py) keeps working where no GPU is: its dry run reports every GPU step skipped
with the reason and writes the JSON a GPU run writes; the SGLang step's own logic runs here with the CPU mover."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.gpu_check import STEPS, _cuda_available, _sglang_round_trip

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_STEPS = set(STEPS) - {"environment"}


@pytest.mark.skipif(_cuda_available(), reason="a CUDA device is here: make gpu-check runs for real")
def test_the_dry_run_skips_every_gpu_step_and_writes_its_json(tmp_path) -> None:
    out = subprocess.run([sys.executable, "bench/gpu_check.py", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    with open(tmp_path / "gpu_check.json") as f:
        result = json.load(f)
    steps = result["steps"]
    assert set(steps) == set(STEPS)
    assert steps["environment"]["status"] == "ok" and steps["environment"]["cuda"] is False
    assert steps["environment"]["native"] == {"_kvindex": True, "_kvcopy": True, "_kvuring": True}
    for name in GPU_STEPS:
        assert steps[name]["status"] == "skipped" and steps[name]["reason"] == "skipped: no CUDA", name
    assert result["summary"] == {name: steps[name]["status"] for name in STEPS}


def test_a_failing_step_is_recorded_and_the_next_one_runs(tmp_path) -> None:
    from bench.gpu_check import Check

    check = Check(str(tmp_path))
    check.run("broken", lambda c: {"x": 1 // 0})
    check.run("fine", lambda c: {"x": 1})
    with open(tmp_path / "gpu_check.json") as f:
        steps = json.load(f)["steps"]
    assert steps["broken"]["status"] == "failed" and "ZeroDivisionError" in steps["broken"]["error"]
    assert steps["fine"] == {"status": "ok", "x": 1, "seconds": steps["fine"]["seconds"]}


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_the_sglang_layout_step_round_trips_through_the_daemon_with_the_cpu_mover(daemon, kind: str) -> None:
    with daemon.client() as c:
        row = _sglang_round_trip(c, kind, "cpu", device="cpu")
    assert row["slots_exact"] and row["crcs_match"] and row["verified"] and row["load_exact"], row
    assert row["page_bytes"] == (4 * 2 * 16 * 8 * 128 * 2 if kind == "mha" else 4 * 16 * 576 * 2)

"""The vLLM connector with real vLLM engines (CPU build, tiny random Llamas built here) and a real daemon process.

Each engine runs in a fresh process (tests/vllm_engine_run.py, ~15 s each, most of it `import vllm`), so the
scenarios are grouped: one engine process goes through several steps while the test changes the daemon between
them. Prompts are 200 tokens in blocks of 32: 6 full blocks (192 tokens) can come from the daemon, the block holding
the last prompt token is always computed.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import DaemonProc
from tests.engine_guard import engine_missing

pytestmark = pytest.mark.vllm

try:  # the engine runs in other processes, but they need vLLM in this interpreter's environment
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means: no engine here
    engine_missing("vllm", e)   # a skip, or a failure where KVSTORE_REQUIRE_ENGINES names vllm (make test)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "vllm_engine_run.py")
_RNG = random.Random(7)
PROMPT = [_RNG.randrange(4, 1024) for _ in range(200)]     # (one generator: not one token 200 times)
HIT = 192          # 6 blocks of 32; the 7th holds the last prompt token
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
       "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two tiny Llamas with the same architecture (so the same geometry) and different weights."""
    d = tmp_path_factory.mktemp("models")
    m1, m2 = str(d / "llama-a"), str(d / "llama-b")
    subprocess.run([sys.executable, SCRIPT, "build", m1, "1", m2, "2"], check=True, env=ENV, capture_output=True,
                   timeout=120)
    return m1, m2


class Engine:
    """One engine process going through `steps`; `results()` yields each step's result, `wait_point()` blocks until
    the engine waits for the test (then the test acts and calls `go()`)."""

    def __init__(self, model: str, daemon: DaemonProc, steps: list[dict], log: Path, *args: str,
                 script: str = SCRIPT) -> None:
        self.log_path = log
        self.log = open(log, "w")           # everything the engine printed (vLLM logs to stdout)
        self.proc = subprocess.Popen([sys.executable, script, "run", "--model", model, "--socket", daemon.socket,
                                      "--steps", json.dumps(steps), *args], env=ENV, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.waiting: str | None = None

    def next_line(self, timeout: float = 180.0) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            self.log.write(line)
            if not line:
                self.proc.wait(10)
                raise AssertionError(f"engine exited with {self.proc.returncode}:\n{self.read_log()[-4000:]}")
            if line.startswith(("RESULT ", "WAIT ")):
                return line.strip()
        raise TimeoutError("engine too slow")

    def result(self) -> dict:
        line = self.next_line()
        assert line.startswith("RESULT "), line
        return json.loads(line[len("RESULT "):])

    def wait_point(self) -> None:
        line = self.next_line()
        assert line.startswith("WAIT "), line
        self.waiting = line[len("WAIT "):]

    def go(self) -> None:
        assert self.waiting is not None
        Path(self.waiting).touch()
        self.waiting = None

    def finish(self) -> str:
        assert self.proc.stdout is not None
        self.log.write(self.proc.stdout.read())
        assert self.proc.wait(60) == 0, self.read_log()[-4000:]
        self.log.close()
        return self.read_log()

    def read_log(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_engine(model: str, daemon: DaemonProc, steps: list[dict], log: Path, *args: str,
               script: str = SCRIPT) -> tuple[list[dict], str]:
    e = Engine(model, daemon, steps, log, *args, script=script)
    try:
        results = [e.result() for _ in steps]
        return results, e.finish()
    finally:
        e.kill()


def step(wait: Path | None = None, max_tokens: int = 12) -> dict:
    return {"tokens": PROMPT, "max_tokens": max_tokens, "wait": str(wait) if wait else None}


def alter_all_blocks(daemon: DaemonProc, model: str) -> int:
    """Overwrite every stored block of `model` in place, through a client's mapping of the slots, with noise."""
    rng = np.random.default_rng(0)
    n = 0
    with daemon.client() as c:
        for row in c.list()["namespaces"]:
            if row["model"] != model:
                continue
            for _key, gid in c.list(ns=row["id"], limit=1000)["keys"]:
                view = c.slot(gid).view(np.float32)
                view[:] = rng.normal(0.0, 5.0, view.size).astype(np.float32)
                n += 1
    return n


def test_fresh_engine_loads_from_daemon_and_survives_its_faults(models, tmp_path, start_daemon):
    m1, _ = models
    daemon = start_daemon(capacity="64MiB", segment="1MiB")

    # A computes the prompt and saves its 6 full blocks, layer by layer
    (a,), _ = run_engine(m1, daemon, [step()], tmp_path / "a.log")
    assert a["num_cached_tokens"] == 0
    with daemon.client() as c:
        rows = [r for r in c.list()["namespaces"] if r["model"] == m1]
        assert [r["blocks"] for r in rows] == [6]
        assert rows[0]["geometry"]["layout"] == "vllm-cpu:heads,tokens,2*dim"

    flags = [tmp_path / f"go{i}" for i in range(3)]
    b = Engine(m1, daemon, [step(), step(flags[0]), step(flags[1]), step(flags[2]), step()], tmp_path / "b.log")
    try:
        # 1. a fresh process: the prefix comes from the daemon, the greedy output is A's
        r1 = b.result()
        assert (r1["num_cached_tokens"], r1["output"]) == (HIT, a["output"])

        # 2. the daemon's copies altered in place: the connector checks each block against the CRC-32 committed
        #    with it, reports the altered blocks as load errors, and vLLM recomputes them: A's output, not noise
        b.wait_point()
        assert alter_all_blocks(daemon, m1) == 6
        b.go()
        r2 = b.result()
        assert r2["output"] == a["output"], "altered KV was used"

        # 3. the daemon stopped: no hit, B recomputes and still answers A's output
        b.wait_point()
        daemon.stop()
        b.go()
        r3 = b.result()
        assert (r3["num_cached_tokens"], r3["output"]) == (0, a["output"])

        # 4. a new (empty) daemon on the same socket: B reconnects by itself, stores again, then hits again
        b.wait_point()
        daemon.start()
        time.sleep(0.6)                      # > retry_s: the connector's next attempt connects
        b.go()
        r4, r5 = b.result(), b.result()
        assert (r4["num_cached_tokens"], r4["output"]) == (0, a["output"])
        assert (r5["num_cached_tokens"], r5["output"]) == (HIT, a["output"])
        log = b.finish()
    finally:
        b.kill()
    assert "does not match its checksum: recomputed" in log, log   # detected, not silently recomputed by luck
    # one line per outage and role, and the way back
    assert log.count("daemon unavailable") == 2, log
    assert log.count("is back after") == 2, log
    print(f"\nA {a}\nB {r1}\nB altered {r2}\nB daemon down {r3}\nB reconnected {r4} {r5}")


def test_a_prompt_prefilled_in_chunks_is_stored_whole_and_verified(models, tmp_path, start_daemon):
    """A prompt longer than vLLM's token budget per step is prefilled over several steps: each step saves the blocks
    it completed (a new reservation per step, its CRC-32C chained layer by layer), after a head of the prompt came
    from the daemon (the reservations skip the blocks it holds). Every block must come back and pass its checksum in
    a fresh engine, itself prefilling in chunks."""
    m1, _ = models
    daemon = start_daemon(capacity="64MiB", segment="1MiB")
    long = [_RNG.randrange(4, 1024) for _ in range(900)]           # 28 full blocks, 10 steps of 96 tokens
    head, whole = ({"tokens": t, "max_tokens": 8, "wait": None} for t in (long[:200], long))
    (a1, a2), _ = run_engine(m1, daemon, [head, whole], tmp_path / "a.log", "--batch", "96")
    assert (a1["num_cached_tokens"], a2["num_cached_tokens"]) == (0, 6 * 32)
    with daemon.client() as c:
        assert [r["blocks"] for r in c.list()["namespaces"] if r["model"] == m1] == [28]
    (b,), log = run_engine(m1, daemon, [whole], tmp_path / "b.log", "--batch", "96")
    assert "does not match its checksum" not in log, log
    assert (b["num_cached_tokens"], b["output"]) == (28 * 32, a2["output"])


def test_an_engine_speaks_for_its_tenant(models, tmp_path, daemons):
    """`tenant` / `tenant_secret` in the extra config: the engine's blocks are its tenant's (its quota's), and a
    wrong secret gets no cache at all, not another tenant's."""
    m1, _ = models
    conf = tmp_path / "kvstore.yaml"
    conf.write_text(json.dumps({"tenants": [{"name": "team-a", "secret": "sa", "host": "32MiB"}]}))
    daemon = DaemonProc(capacity="64MiB", segment="1MiB", env={"KVSTORE_CONFIG": str(conf)}).start()
    daemons.append(daemon)
    (a,), _ = run_engine(m1, daemon, [step()], tmp_path / "a.log", "--extra",
                         json.dumps({"tenant": "team-a", "tenant_secret": "sa"}))
    with daemon.client() as c:
        assert [(r["tenant"], r["blocks"]) for r in c.list()["namespaces"]] == [("team-a", 6)]
        row = next(r for r in c.tenants()["tenants"] if r["tenant"] == "team-a")
        assert row["used_bytes"] > 0 and row["quota_bytes"] == 32 << 20
    (w,), log = run_engine(m1, daemon, [step()], tmp_path / "w.log", "--extra",
                           json.dumps({"tenant": "team-a", "tenant_secret": "wrong"}))
    assert (w["num_cached_tokens"], w["output"]) == (0, a["output"])
    assert "wrong secret for tenant 'team-a'" in log, log[-3000:]


def test_two_models_never_hit_each_other(models, tmp_path, start_daemon):
    m1, m2 = models
    daemon = start_daemon(capacity="64MiB", segment="1MiB")
    (a,), _ = run_engine(m1, daemon, [step()], tmp_path / "a.log")
    # same architecture, same geometry, same prompt, same block hashes: only the namespace tells them apart
    c1, c2 = run_engine(m2, daemon, [step(), step()], tmp_path / "c.log")[0]
    assert c1["num_cached_tokens"] == 0               # model A's blocks are not model B's
    assert c2["num_cached_tokens"] == HIT             # its own blocks hit
    assert c1["output"] == c2["output"] != a["output"]
    with daemon.client() as c:
        rows = sorted((r["model"], r["blocks"]) for r in c.list()["namespaces"])
    assert rows == [(m1, 6), (m2, 6)]
    print(f"\nmodel A {a}\nmodel B {c1} {c2}")


def test_hit_survives_a_daemon_restart_through_the_ssd_tier(models, tmp_path, start_daemon):
    m1, _ = models
    ssd = str(tmp_path / "ssd")
    daemon = start_daemon(capacity="64MiB", segment="1MiB", env={"KVSTORE_SSD_DIR": ssd})
    (a,), _ = run_engine(m1, daemon, [step()], tmp_path / "a.log")
    with daemon.client() as c:
        assert c.evict(everything=True)["blocks"] == 6   # an operator's flush: every block demoted to SSD
    assert daemon.stop() == 0                           # graceful: the staged blocks are written first
    daemon.start()                                      # a new process: the host pool is empty, the SSD is not
    with daemon.client() as c:
        assert c.stats()["tiers"][1]["blocks"] == 6
    (b,), _ = run_engine(m1, daemon, [step()], tmp_path / "b.log")
    assert (b["num_cached_tokens"], b["output"]) == (HIT, a["output"])
    with daemon.client() as c:
        assert c.stats()["counters"]["promotions"] == 6   # the prefix came back from SSD
    print(f"\nA {a}\nB after a restart {b}")

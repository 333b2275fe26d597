"""The daemon restarted under a running vLLM engine (issue 19, part 4): gracefully, then with kill -9, on the same
socket and SSD directory, while the engine keeps generating. The engine never sees an error (every request finishes,
with the greedy output of a run without any cache), serves while no daemon is there, reconnects by itself, and its
requests hit the durable blocks as soon as the restarted daemon serves them.

One engine process (tests/connectors/restart_engine_run.py, a real vLLM engine with a tiny random Llama) goes
through the whole scenario, steered through its stdin. Prompts are 200 tokens in blocks of 32: a 4-block prefix
shared by all (128 tokens), 2 blocks of their own, and the block holding the last prompt token (always computed).
Hits are vLLM's own `num_cached_tokens` of each request.
"""
from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import DaemonProc, ssd_settled
from tests.engine_guard import engine_missing

pytestmark = pytest.mark.vllm

try:  # the engine runs in another process, but it needs vLLM in this interpreter's environment
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means: no engine here
    engine_missing("vllm", e)

# The SSD tier's record maps book the disk before a restarted daemon serves, so hits are expected from its first
# answer on. True waits for the restart pass (scan or validation, in stats) before it expects hits: what a daemon
# that scans its records while it serves (a file without a trusted map) needs.
SCAN_BEFORE_HITS = False

ROOT = Path(__file__).resolve().parents[2]
RUN = str(ROOT / "tests" / "connectors" / "restart_engine_run.py")
BUILD = str(ROOT / "tests" / "vllm_engine_run.py")
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
       "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
SHARED = [random.Random(19 + i).randrange(4, 1024) for i in range(128)]
SHARED_HIT, FULL_HIT = 128, 192
VARIANTS = 12          # prompts of a loop: each stores its own 2 blocks the first time it runs


def prompt(tag: int) -> list[int]:
    rng = random.Random(tag)
    return SHARED + [rng.randrange(4, 1024) for _ in range(72)]


def key(p: list[int]) -> str:
    return json.dumps(p)


RETRY_S = 5.0                  # the connector's default retry_s


class Engine:
    """The engine process: `send` a command, `next(tag)` its answer lines; everything it prints goes to `log`."""

    def __init__(self, model: str, socket: str, log: Path) -> None:
        self.log_path = log
        # retry_s as configured by default: a restarted daemon must not wait for it
        extra = json.dumps({"retry_s": RETRY_S, "timeout_s": 5.0})
        self.proc = subprocess.Popen([sys.executable, RUN, "--model", model, "--socket", socket, "--extra", extra],
                                     env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith(("READY", "RESULT ", "ROUND ")):
                    self.lines.put(line.strip())
        self.lines.put(None)

    def send(self, cmd: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def next_line(self, timeout: float = 240.0) -> tuple[str, dict]:
        """The next answer: its tag ("READY", "RESULT " or "ROUND ") and its fields."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no answer from the engine in {timeout} s:\n{self.tail()}") from None
        if line is None:
            self.proc.wait(10)
            raise AssertionError(f"the engine exited with {self.proc.returncode}:\n{self.tail()}")
        tag = "READY" if line == "READY" else line[:line.index(" ") + 1]
        return tag, json.loads(line[len(tag):] or "{}")

    def next(self, tag: str) -> dict:
        got, fields = self.next_line()
        assert got == tag, f"{got}{fields}\n{self.tail()}"
        return fields

    def generate(self, prompts: list[list[int]]) -> dict:
        self.send({"prompts": prompts})
        return self.next("RESULT ")

    def finish(self) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.close()                          # the script's command loop ends
        assert self.proc.wait(60) == 0, self.tail()
        return self.log_path.read_text(errors="replace")

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("models") / "llama")
    subprocess.run([sys.executable, BUILD, "build", path, "1"], check=True, env=ENV, capture_output=True, timeout=120)
    return path


class TimedDaemon(DaemonProc):
    """A DaemonProc that notes when its process was seen to end (time.monotonic(): the clock of a ROUND's start)."""

    stopping_at = 0.0
    stopped_at = 0.0

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        code = super().stop(sig, timeout)
        self.stopped_at = time.monotonic()
        return code


def restart_under_load(engine: Engine, d: TimedDaemon, sig: int, prompts: list[list[int]],
                       flag: Path) -> tuple[list[dict], float]:
    """The engine generates `prompts` in turn while the daemon is stopped with `sig`, serves at least one request
    from start to end with no daemon, and a new daemon starts on the same socket and SSD directory. Returns every
    generate's ROUND, and when the new daemon was ready (answering; and scanned, with SCAN_BEFORE_HITS)."""
    engine.send({"loop": prompts, "until": str(flag)})
    rounds = [engine.next("ROUND ")]                     # the engine is busy: requests in flight from now on
    d.stopping_at = time.monotonic()
    d.stop(sig)
    while rounds[-1]["start"] < d.stopped_at:            # until a request has run without any daemon
        rounds.append(engine.next("ROUND "))
    d.start(wait=False)
    d.wait_ready(timeout=60, scanned=SCAN_BEFORE_HITS)
    ready = time.monotonic()
    while sum(r["start"] > ready for r in rounds) < 3:   # three requests started after the daemon was ready
        rounds.append(engine.next("ROUND "))
    flag.touch()
    while (line := engine.next_line())[0] == "ROUND ":
        rounds.append(line[1])
    assert line[0] == "RESULT " and line[1]["generates"] == len(rounds), line
    return rounds, ready


def check(rounds: list[dict], prompts: list[list[int]], refs: dict[str, list[int]], ready: float, what: str) -> None:
    for r in rounds:                                     # no request failed, none used wrong KV
        assert r["finish"] == "length", (what, r)
        assert r["output"] == refs[key(prompts[r["prompt"]])], (what, r)
    late = [r for r in rounds if r["start"] > ready]
    assert len(late) >= 3 and all(r["cached"] >= SHARED_HIT for r in late), (what, late)


def test_engine_serves_through_graceful_and_kill9_restarts_and_hits_durable_blocks(model, tmp_path, daemons):
    d = TimedDaemon(capacity="64MiB", segment="1MiB",
                    env={"KVSTORE_SSD_CAPACITY": "64MiB", "KVSTORE_SSD_WRITE_THROUGH": "true",
                         "KVSTORE_SSD_SYNC": "always"})
    d.env["KVSTORE_SSD_DIR"] = os.path.join(d.dir, "ssd")
    daemons.append(d)
    base = prompt(0)
    graceful = [prompt(100 + i) for i in range(VARIANTS)]
    killed = [prompt(200 + i) for i in range(VARIANTS)]
    engine = Engine(model, d.socket, tmp_path / "engine.log")
    try:
        engine.next("READY")
        # 1. no daemon yet: every request is computed, and these are the outputs to compare with (no cache at all)
        everything = [base] + graceful + killed
        ref = engine.generate(everything)
        assert ref["cached"] == [0] * len(everything) and set(ref["finish"]) == {"length"}
        refs = {key(p): out for p, out in zip(everything, ref["outputs"])}

        # 2. the daemon starts: the engine finds it at its next request, stores, then hits; made durable
        d.start()
        first = engine.generate([base])
        assert (first["cached"], first["outputs"]) == ([0], [refs[key(base)]])
        again = engine.generate([base])
        assert (again["cached"], again["outputs"]) == ([FULL_HIT], [refs[key(base)]])
        with d.client() as c:
            ssd_settled(c)

        # 3. graceful restart, then 4. kill -9, each while the engine generates (loads and stores in flight)
        for sig, prompts, what in ((signal.SIGTERM, graceful, "graceful"), (signal.SIGKILL, killed, "kill -9")):
            rounds, ready = restart_under_load(engine, d, sig, prompts, tmp_path / f"go-{sig}")
            check(rounds, prompts, refs, ready, what)
            away = [r for r in rounds if d.stopped_at < r["start"] < ready]
            print(f"\n{what}: {len(rounds)} requests, {len(away)} while no daemon was ready; tokens from the "
                  f"cache, by request: {[r['cached'] for r in rounds]} (ready before request "
                  f"{min(r['i'] for r in rounds if r['start'] > ready)})")
            if sig == signal.SIGTERM:    # a graceful stop keeps every block committed before it: full hits
                before = [prompts[r["prompt"]] for r in rounds if r["end"] < d.stopping_at]
                back = engine.generate(before)
                assert before and back["cached"] == [FULL_HIT] * len(before), back
                assert back["outputs"] == [refs[key(p)] for p in before]

        # 5. the base prompt's blocks were durable before both restarts: a full hit, the same output
        last = engine.generate([base])
        assert (last["cached"], last["outputs"]) == ([FULL_HIT], [refs[key(base)]])
        # a role whose request timed out while the daemon stopped sits out retry_s (5 s) before it asks again (on
        # a slow machine a graceful stop can take that long): past it, every role has found the daemon again
        time.sleep(RETRY_S + 0.5)
        after = engine.generate([base])
        assert after["outputs"] == [refs[key(base)]]
        log = engine.finish()
    finally:
        engine.kill()
    assert "Traceback" not in log, log[-6000:]
    # one warning per outage and role, each followed by the way back
    assert log.count("daemon unavailable") == log.count("is back after") >= 2, log[-6000:]

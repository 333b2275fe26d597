"""Blocks for the SSD store's tests (8 KiB payloads, one per key, versions told apart), and a gate that holds the
restart's header reads (a full scan's and a record map's validation) until the test opens it."""
from __future__ import annotations

import threading

import pytest

from kvstore.tiers.ssd import scan
from kvstore.tiers.ssd.record import HEADER_BYTES, padded
from kvstore.tiers.ssd.store import SsdStore

NS = bytes(range(16))
PAYLOAD = 8192
RECORD = HEADER_BYTES + padded(PAYLOAD)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def payload(i: int, version: int = 0) -> bytes:
    return bytes([i % 256, version]) * (PAYLOAD // 2)


def read(s: SsdStore, i: int) -> bytes | None:
    out = bytearray(PAYLOAD)
    return bytes(out) if s.get(NS, h(i), out) else None


def gate_restart(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The restart's header reads wait for the returned event (set it before closing the store)."""
    gate = threading.Event()
    for name in ("_scan_chunk", "_check_chunk"):
        real = getattr(scan.RestartScan, name)

        def gated(self: scan.RestartScan, cf: object, start: int, end: int, real=real) -> None:  # type: ignore
            assert gate.wait(30)
            real(self, cf, start, end)

        monkeypatch.setattr(scan.RestartScan, name, gated)
    return gate

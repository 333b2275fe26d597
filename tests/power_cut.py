"""A model of a power cut, for the power-loss tests: from the log of every write and sync the SSD tier made
(kvstore/tiers/ssd/diskio.py), the directory a power cut at a given moment could have left behind.

A cut just before entry `cut` keeps what was durable then and any part of what was not:
- a write to a file is durable once a sync of that file that began after the write completed has finished; a
  write that is not may be lost or torn: each of its 4 KiB pages lands or not, independently (`keep` is the
  chance it lands), the pages that land in the order they were written;
- a size change (ftruncate, posix_fallocate) is durable with the file's next sync, and lands or not before that;
- a file created is durable once a sync of the directory began after its creation has finished; before that it
  may not exist at all (then nothing written to it survives, synced or not).
Files that existed before the log began are not modelled: the tests start from an empty directory.
"""
from __future__ import annotations

import bisect
import os
import random
from dataclasses import dataclass

from kvstore.tiers.ssd import diskio
from kvstore.tiers.ssd.diskio import ALLOC, CREATE, DIRSYNC, OPEN, SIZE, SYNC, WRITE, Entry

PAGE = 4096


@dataclass
class Cut:
    at: int            # entries before this one happened; none from it on
    time: float        # the moment of the cut: just before entry `at` was logged (no disk call in between, so
    #                    the state is the same), or `end` for a cut after the last entry
    keep: float        # the chance that a page or size change not yet durable lands anyway
    files: dict[str, bytes]


def load(path: str) -> list[Entry]:
    return list(diskio.read_log(path))


def cut_at(entries: list[Entry], at: int, rng: random.Random, keep: float, end: float) -> Cut:
    """The directory a power cut just before entry `at` could leave (one draw of the undurable pages); `end` is
    when the recording stopped (the daemon killed)."""
    synced: dict[int, int] = {}              # file id → entries before this index are durable in it
    dir_synced = 0
    for e in entries[:at]:
        if e.op == SYNC:
            synced[e.fid] = max(synced.get(e.fid, 0), e.a)
        elif e.op == DIRSYNC:
            dir_synced = max(dir_synced, e.a)
    data: dict[int, bytearray] = {}
    names: dict[int, str] = {}
    created: dict[int, int] = {}
    for i, e in enumerate(entries[:at]):
        durable = i < synced.get(e.fid, 0)
        if e.op in (CREATE, OPEN):
            names[e.fid] = e.data.decode()
            data.setdefault(e.fid, bytearray())
            if e.op == CREATE:
                created.setdefault(e.fid, i)
        elif e.op == WRITE:
            _write(data[e.fid], e.a, e.data, durable, rng, keep)
        elif e.op in (SIZE, ALLOC) and (durable or rng.random() < keep):
            _resize(data[e.fid], e.a if e.op == SIZE else max(len(data[e.fid]), e.a + e.b))
    files = {names[f]: bytes(b) for f, b in data.items()
             if created.get(f, -1) < dir_synced or rng.random() < keep}
    return Cut(at, entries[at].t if at < len(entries) else end, keep, files)


def _write(buf: bytearray, offset: int, data: bytes, durable: bool, rng: random.Random, keep: float) -> None:
    for start in range(0, len(data), PAGE):
        if durable or rng.random() < keep:
            page = data[start:start + PAGE]
            at = offset + start
            if len(buf) < at + len(page):
                buf.extend(bytes(at + len(page) - len(buf)))
            buf[at:at + len(page)] = page


def _resize(buf: bytearray, size: int) -> None:
    if size < len(buf):
        del buf[size:]
    else:
        buf.extend(bytes(size - len(buf)))


def materialize(cut: Cut, directory: str) -> None:
    """Write the cut's files into a new private directory, as the daemon would find them after the power cut."""
    os.makedirs(directory, mode=0o700)
    for name, content in cut.files.items():
        fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, content)
        finally:
            os.close(fd)


def cut_plan(entries: list[Entry], n: int, rng: random.Random, settles: list[float],
             acks: list[float]) -> list[tuple[int, float]]:
    """`n` cuts, as (entry, keep), in order. First, just after each settle (up to half of them): the cut keeps only
    what was durable (keep 0), the least that must hold every block the settle made durable. Then a third of the
    rest just after a moment a promise was made (a settle seen, a delete acknowledged: the kind drawn first, so the
    rare settles get their share), a third just before or after a sync (where durability changes), the rest
    anywhere; each keeping all, half or none of what was not durable yet."""
    times = [e.t for e in entries]
    syncs = [i for i, e in enumerate(entries) if e.op in (SYNC, DIRSYNC)]
    kinds = [k for k in (settles, acks) if k]
    plan = [(bisect.bisect_right(times, t), 0.0) for t in settles[:n // 2]]
    while len(plan) < n:
        r = rng.random()
        if kinds and r < 1 / 3:
            at = bisect.bisect_right(times, rng.choice(rng.choice(kinds))) + rng.randint(0, 2)
        elif syncs and r < 2 / 3:
            at = rng.choice(syncs) + rng.choice((0, 1))
        else:
            at = rng.randint(1, len(entries))
        plan.append((at, rng.choice((0.0, 0.5, 1.0))))
    return sorted((min(len(entries), max(1, at)), keep) for at, keep in plan)

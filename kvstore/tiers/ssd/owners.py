"""Whose each block on the SSD is, and each tenant's share of the tier (issue 17: SSD quotas, SwiftCache §3.5).

**Owners.** A namespace digest belongs to one tenant for good: the tenant is part of the digest
(kvstore.protocol.keys), so a record's tenant is a function of its key. The daemon knows it while the namespace is
registered; a restarted daemon must know it before any engine says hello again, or it could not keep a quiet tenant's
SSD blocks from a busy one. So the tier keeps the map in its directory, `owners.kvo`:

    file  = MAGIC (8 bytes) + entries
    entry = digest (16) + name length (1) + name (UTF-8, at most 255 bytes) + CRC-32C of those (4)

An entry is appended (and synced with the write batch's payloads, before any header that needs it: writes.py) the
first time a block of a named tenant's namespace is written; the default tenant "" has no entries (a digest not
in the file is its). Reading stops at the first entry that is torn or fails its CRC (the tail a crash cut), and
the file is rewritten without it. At close, entries whose digest holds no record are dropped (the file is rewritten
whole, then renamed over the old one), so it holds one entry per namespace on the disk.

**Quotas** (`SsdQuotas`, on when any tenant has an `ssd` quota at start; else the tier is one LRU per block size as
before). A tenant's quota is SSD bytes guaranteed to it; what it *uses* is the bytes of its records. Free space
serves whoever writes (a tenant over its quota borrows it). When a block size's file is at the cap and a write
needs a record, the victim comes from, in order:
1. a borrower: among the tenants with a record of that size that stay at or above their quota without it (the
   writer, too, where the record it writes takes it over its own), the one whose victim was used least recently
   (the LRU policy's clock: borrowed space follows use, as in the host pool), or, under a policy without a clock
   (workflow), the one most over its quota;
2. else the writer's own least valuable record of that size (it cycles within what it holds);
3. else the write finds no room (`full`).
So a tenant is never pushed below its quota by another's writes. Each tenant's records of a block size are an
eviction class of the tier's policy (LRU or workflow), so the victim within a tenant is its policy's.

Tenants are usually models, so block sizes differ, and records of one size live in that size's file, which never
shrinks but by `resize`. A writer within its quota that finds no borrower's record of its own size (step 1 gives
none) therefore takes room from borrowers of *other* sizes: their records are evicted by the same rule (none
below its quota) and punched out of their files (files.punch: the disk space goes back, the
record becomes a hole), until its file may grow by one record within the cap; only then does it fall back to its
own records (step 2). The cap bounds the bytes allocated on the disk (files' sizes less their holes). A write that
finds no room at all is `full`, and `quota_blocked` when the quotas were the reason.
"""
from __future__ import annotations

import logging
import os
import struct
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvstore.checksum import crc32c

log = logging.getLogger("kvstore")
MAGIC = b"KVSOWN01"
FILE = "owners.kvo"
MAX_NAME = 255
_HEAD = struct.Struct("<16sB")


def _entry(digest: bytes, tenant: str) -> bytes:
    name = tenant.encode()
    body = _HEAD.pack(digest, len(name)) + name
    return body + struct.pack("<I", crc32c(body))


def parse(raw: bytes) -> tuple[dict[bytes, str], int]:
    """The entries of a file's bytes, and how many bytes of it are whole (the rest is a torn or damaged tail)."""
    if raw[:len(MAGIC)] != MAGIC:
        return {}, 0
    owners: dict[bytes, str] = {}
    at = len(MAGIC)
    while at + _HEAD.size <= len(raw):
        digest, n = _HEAD.unpack_from(raw, at)
        end = at + _HEAD.size + n
        if end + 4 > len(raw) or struct.unpack_from("<I", raw, end)[0] != crc32c(raw[at:end]):
            break
        try:
            owners[digest] = raw[at + _HEAD.size:end].decode()
        except UnicodeDecodeError:
            break
        at = end + 4
    return owners, at


class Owners:
    """The digest → tenant map of one SSD directory (module docstring). Not thread-safe: the store's lock."""

    def __init__(self, directory: str, synced: bool = True) -> None:
        self.path = os.path.join(directory, FILE)
        self.synced = synced
        self.known: dict[bytes, str] = {}
        self.pending: list[bytes] = []          # entries appended, not yet written
        self._fd = -1

    def open(self) -> "Owners":
        try:
            os.unlink(self.path + ".tmp")           # a rewrite a crash cut short: the old file is still whole
        except FileNotFoundError:
            pass
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raw = b""
        self.known, whole = parse(raw)
        if whole != len(raw) and raw:
            log.warning("ssd: %s: %d bytes after the last whole entry dropped (a write cut short); blocks of the "
                        "namespaces they named count as the default tenant's", self.path, len(raw) - whole)
        if whole != len(raw) or not raw:
            self._rewrite(self.known)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        return self

    def tenant(self, digest: bytes) -> str:
        return self.known.get(digest, "")

    def learn(self, digest: bytes, tenant: str | None) -> None:
        """(Under the store's lock.) The digest's tenant, written with the next batch if it is new and named."""
        if not tenant or digest in self.known:
            return
        self.known[digest] = tenant
        if len(tenant.encode()) > MAX_NAME:          # (64 characters of UTF-8 may take 256 bytes)
            log.warning("ssd: tenant %r has a name of over %d bytes: whose its SSD blocks are is not kept across a "
                        "restart (they count as the default tenant's after one); give it a shorter name",
                        tenant[:32], MAX_NAME)
            return
        self.pending.append(_entry(digest, tenant))

    def take_pending(self) -> list[bytes]:
        """(Under the store's lock.) The entries learnt since the last call, for `append`."""
        entries, self.pending = self.pending, []
        return entries

    def append(self, entries: list[bytes], synced: bool) -> None:
        """(A path worker, in the write batch, before its headers: without the store's lock.) Write entries from
        `take_pending`, synced where the batch's records are."""
        if entries and self._fd >= 0:
            try:
                os.write(self._fd, b"".join(entries))
                if synced:
                    os.fdatasync(self._fd)
            except OSError:
                self.pending[:0] = entries      # written again with the next batch (this one publishes nothing)
                raise

    def close(self, live: Iterable[bytes] = ()) -> None:
        """Drop the entries of digests that hold no record (`live`: those that do), then close."""
        if self._fd < 0:
            return
        self.append(self.take_pending(), self.synced)
        os.close(self._fd)
        self._fd = -1
        holding = set(live)
        keep = {d: t for d, t in self.known.items() if d in holding}
        if len(keep) < len(self.known):
            self._rewrite(keep)

    def _rewrite(self, owners: dict[bytes, str]) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(MAGIC + b"".join(_entry(d, t) for d, t in owners.items() if len(t.encode()) <= MAX_NAME))
            f.flush()
            if self.synced:
                os.fsync(f.fileno())
        os.replace(tmp, self.path)


@dataclass(slots=True)
class SsdQuotas:
    """Each tenant's guaranteed SSD bytes and what its records use (module docstring)."""
    quotas: dict[str, int] = field(default_factory=dict)     # tenant -> guaranteed bytes
    default: int = 0                                         # the quota of a tenant not listed
    used: Counter[str] = field(default_factory=Counter)      # bytes of each tenant's records
    placing: Counter[str] = field(default_factory=Counter)   # ... and of those the write batch in flight placed
    evictions: Counter[str] = field(default_factory=Counter)  # its records evicted (by anyone's write)
    taken: Counter[str] = field(default_factory=Counter)      # ... of them for another tenant's write
    counters: Counter[str] = field(default_factory=Counter)

    def quota(self, tenant: str) -> int:
        return self.quotas.get(tenant, self.default)

    def total(self) -> int:
        return sum(self.quotas.values()) + self.default

    def set(self, tenant: str, nbytes: int, capacity: int) -> None:
        """Change a quota online (O(1): nothing moves until a write needs the room); ValueError if the quotas
        would no longer fit the tier."""
        if nbytes < 0:
            raise ValueError(f"an SSD quota cannot be negative ({nbytes})")
        total = self.total() - self.quota(tenant) + nbytes if tenant in self.quotas else self.total() + nbytes
        if total > capacity:
            raise ValueError(f"the tenants' SSD quotas would total {total} bytes, above the tier's capacity "
                             f"({capacity} bytes): lower another tenant's first, or resize the tier")
        self.quotas[tenant] = nbytes

    def held(self, tenant: str) -> int:
        """Its records' bytes, those the write batch in flight placed included (a batch may evict a tenant's
        records for its own next blocks: until they are published, `used` alone would show it below its quota)."""
        return self.used[tenant] + self.placing[tenant]

    def victim_tenant(self, writer: str, record: int, holders: Callable[[], Iterable[str]],
                      age: Callable[[str], int | None] | None = None) -> str | None:
        """Whose record of this size a write of `writer` (a `record`-byte record) takes at the cap; None if no one's
        may go. `holders()`: the tenants with a record of this size; `age(t)`: when t's victim of this size was
        last used (the tier's LRU clock), None where the policy keeps no clock."""
        eligible = []
        for t in holders():
            over = self.held(t) - self.quota(t) + (record if t == writer else 0)
            if (t == writer and over > 0) or (t != writer and over >= record):
                eligible.append((t, over))
        if eligible:
            return _pick(eligible, writer, age)
        return writer if writer in set(holders()) else None

    def within(self, tenant: str, record: int) -> bool:
        """Whether `tenant` stays within its quota with one more `record`-byte record."""
        return self.held(tenant) + record <= self.quota(tenant)

    def borrower(self, writer: str, records: Counter[tuple[str, int]], exclude: int, record: Callable[[int], int],
                 age: Callable[[tuple[str, int]], int | None] | None = None) -> tuple[str, int] | None:
        """The (tenant, block size) whose record gives room to `writer` across sizes, by the rule of
        `victim_tenant` among the tenants other than the writer that stay at or above their quota without one
        record of that size (`records`: records per (tenant, size); `exclude`: the writer's own size;
        `record(size)`: a record's bytes; `age((t, size))`: when that class's victim was last used)."""
        eligible = [((t, p), over) for t, p, _, over in self._others(writer, records, exclude) if over >= record(p)]
        return _pick(eligible, None, age) if eligible else None

    def _others(self, writer: str, records: Counter[tuple[str, int]], exclude: int
                ) -> Iterable[tuple[str, int, int, int]]:
        """(tenant, block size, records, bytes over its quota) of every tenant but `writer` holding records of a
        size other than `exclude`: the candidates of `borrower` and `giveable`."""
        for (t, p), n in records.items():
            if n > 0 and p != exclude and t != writer:
                yield t, p, n, self.held(t) - self.quota(t)

    def giveable(self, writer: str, records: Counter[tuple[str, int]], exclude: int,
                 record: Callable[[int], int]) -> int:
        """At most how many bytes `borrower`'s loop can free for `writer` (arguments as there): a tenant gives
        whole records while it stays at or above its quota, so with one other block size it gives exactly its
        excess rounded down to that size's records (the usual case: a tenant is a model), and with several at
        most its excess. A bound the loop never beats, so a write it cannot serve evicts no one's block for
        nothing (before, the loop punched records until the borrowers ran out, and the room it made served no one
        but the borrower's next write)."""
        sizes: dict[str, list[tuple[int, int]]] = {}
        excess: dict[str, int] = {}
        for t, p, n, over in self._others(writer, records, exclude):
            if over > 0:
                sizes.setdefault(t, []).append((record(p), n))
                excess[t] = over
        total = 0
        for t, held in sizes.items():
            if len(held) == 1:
                rec, n = held[0]
                total += min(n, excess[t] // rec) * rec
            else:
                total += min(excess[t], sum(rec * n for rec, n in held))
        return total

    def evicted(self, victim: str, writer: str, record: int) -> None:
        self.evictions[victim] += 1
        if victim != writer:
            self.taken[victim] += 1

    def rows(self, tenants: Iterable[str]) -> dict[str, dict[str, int]]:
        """Per tenant (those named and those with records): quota, used, borrowed, evictions, taken."""
        names = set(tenants) | {t for t, n in self.used.items() if n} | set(self.quotas)
        return {t: {"ssd_quota_bytes": self.quota(t), "ssd_used_bytes": self.used[t],
                    "ssd_borrowed_bytes": max(0, self.used[t] - self.quota(t)), "ssd_evictions": self.evictions[t],
                    "ssd_taken": self.taken[t]} for t in sorted(names)}


def _pick(eligible: list[tuple[Any, int]], writer: Any, age: Callable[[Any], int | None] | None) -> Any:
    """Among (candidate, bytes over its quota): the one whose victim was used least recently where the policy keeps
    a clock (memory follows use among borrowers, as in the host pool), else the most over (ties: the writer's own)."""
    if age is not None:
        aged = [(a, c) for c, _ in eligible if (a := age(c)) is not None]
        if len(aged) == len(eligible):
            return min(aged, key=lambda x: x[0])[1]
    return max(eligible, key=lambda x: (x[1], x[0] == writer))[0]

"""Tenants' SSD quotas on a real record store (kvstore.tiers.ssd.owners): a borrower's records make room for a tenant
within its quota, a tenant at its quota cycles its own, nobody is pushed below its quota, whose each record is
survives a restart (owners.kvo, torn tail included), and quotas change online within the tier's capacity."""
from __future__ import annotations

import os

import pytest

from kvstore.tiers.ssd.owners import FILE, MAGIC, SsdQuotas, parse
from kvstore.tiers.ssd.record import HEADER_BYTES
from kvstore.tiers.ssd.store import SsdStore

PAYLOAD = 8192
RECORD = HEADER_BYTES + PAYLOAD
NS = {"a": b"A" * 16, "b": b"B" * 16, "c": b"C" * 16}
OWNER = {d: t for t, d in NS.items()}


def open_store(d: str, quotas: dict[str, int] | None, records: int = 8, knows: bool = True) -> SsdStore:
    """A store of `records` records; `quotas` in records (None: no SSD quotas); `knows`: the daemon's digest →
    tenant map is there (after a restart, before any hello, it is not)."""
    q = None if quotas is None else SsdQuotas({t: n * RECORD for t, n in quotas.items()})
    s = SsdStore(d, records * RECORD, quotas=q)
    if knows:
        s.tenant_of = OWNER.get
    return s.open()


def data(tenant: str, i: int) -> bytes:
    return (f"{tenant}{i:04d}".encode() * (PAYLOAD // 5 + 1))[:PAYLOAD]


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def put(s: SsdStore, tenant: str, ids: range) -> int:
    return sum(s.put_many([(NS[tenant], key(i), data(tenant, i))]) for i in ids)   # one at a time: LRU order


def held(s: SsdStore, tenant: str, ids: range) -> list[int]:
    """The ids of `tenant` the store serves byte for byte."""
    out = bytearray(PAYLOAD)
    return [i for i in ids if s.get(NS[tenant], key(i), out) and bytes(out) == data(tenant, i)]


def test_a_borrower_gives_back_and_nobody_is_pushed_below_its_quota(tmp_path):
    s = open_store(str(tmp_path), {"a": 4, "b": 4})
    assert put(s, "b", range(8)) == 8                  # b borrows a's unused half: free space serves whoever writes
    assert put(s, "a", range(4)) == 4                  # a within its quota: each write takes a record of b's ...
    assert held(s, "b", range(8)) == [4, 5, 6, 7]      # ... its least recently used, until b is back at its quota
    assert put(s, "a", range(4, 7)) == 3               # a over its quota: it cycles its own; b stays at its quota
    assert held(s, "a", range(7)) == [3, 4, 5, 6] and held(s, "b", range(8)) == [4, 5, 6, 7]
    rows = s.quotas.rows([])
    assert rows["a"]["ssd_used_bytes"] == rows["b"]["ssd_used_bytes"] == 4 * RECORD
    assert (rows["b"]["ssd_evictions"], rows["b"]["ssd_taken"]) == (4, 4)
    assert (rows["a"]["ssd_evictions"], rows["a"]["ssd_taken"]) == (3, 0)
    s.close()


def test_without_ssd_quotas_the_tier_is_one_lru(tmp_path):
    s = open_store(str(tmp_path), None)                # the same writes: the busy tenant takes the quiet one's blocks
    put(s, "b", range(8))
    put(s, "a", range(7))
    assert held(s, "b", range(8)) == [7] and held(s, "a", range(7)) == list(range(7))
    assert not s.split
    s.close()


def test_borrowers_give_back_the_largest_first(tmp_path):
    s = open_store(str(tmp_path), {"a": 4, "b": 1, "c": 1}, records=8)
    put(s, "b", range(4))                              # b 3 over its quota
    put(s, "c", range(2))                              # c 1 over
    put(s, "a", range(2))                              # the tier is full (8 records)
    put(s, "a", range(2, 4))                           # a's next two: from b, the most over, not from c
    assert held(s, "b", range(4)) == [2, 3] and held(s, "c", range(2)) == [0, 1]
    put(s, "a", range(4, 5))                           # a at its quota: a (with this record), b and c 1 over each:
    assert held(s, "a", range(5)) == [1, 2, 3, 4]      # a tie goes to the writer's own
    assert held(s, "b", range(4)) == [2, 3] and held(s, "c", range(2)) == [0, 1]
    s.close()


def test_owners_survive_a_restart_and_quotas_hold_before_any_hello(tmp_path):
    d = str(tmp_path)
    s = open_store(d, {"a": 4, "b": 4})
    put(s, "b", range(8))
    s.close()
    s = open_store(d, {"a": 4, "b": 4}, knows=False)   # restarted: no namespace registered yet
    rows = s.quotas.rows([])
    assert rows["b"]["ssd_used_bytes"] == 8 * RECORD and rows.get("", {}).get("ssd_used_bytes", 0) == 0
    s.tenant_of = OWNER.get                            # a's engine says hello and writes
    put(s, "a", range(4))
    assert held(s, "b", range(8)) == [4, 5, 6, 7] and held(s, "a", range(4)) == [0, 1, 2, 3]
    s.close()
    owners, whole = parse(open(os.path.join(d, FILE), "rb").read())
    assert owners == {NS["a"]: "a", NS["b"]: "b"}      # one entry per namespace on the disk


def test_a_torn_owners_tail_is_dropped_and_the_whole_entries_kept(tmp_path):
    d = str(tmp_path)
    s = open_store(d, {"a": 4, "b": 4})
    put(s, "a", range(2))
    put(s, "b", range(2))
    s.close()
    path = os.path.join(d, FILE)
    raw = open(path, "rb").read()
    assert raw.startswith(MAGIC) and parse(raw)[1] == len(raw)
    with open(path, "ab") as f:
        f.write(NS["c"] + b"\x05ab")                   # an entry a crash cut short
    s = open_store(d, {"a": 4, "b": 4}, knows=False)
    rows = s.quotas.rows([])
    assert rows["a"]["ssd_used_bytes"] == rows["b"]["ssd_used_bytes"] == 2 * RECORD
    assert open(path, "rb").read() == raw               # rewritten without the torn tail
    s.close()
    with open(path, "r+b") as f:                        # a flipped byte in b's entry: b's records are the default's
        f.seek(len(raw) - 6)
        byte = f.read(1)
        f.seek(len(raw) - 6)
        f.write(bytes([byte[0] ^ 1]))
    s = open_store(d, {"a": 4, "b": 4}, knows=False)
    rows = s.quotas.rows([])
    assert rows[""]["ssd_used_bytes"] == 2 * RECORD and rows["b"]["ssd_used_bytes"] == 0
    s.close()


def test_quotas_change_online_within_the_capacity(tmp_path):
    q = SsdQuotas({"a": 4 * RECORD})
    with pytest.raises(ValueError, match="above the tier's capacity"):
        q.set("b", 5 * RECORD, 8 * RECORD)
    q.set("b", 4 * RECORD, 8 * RECORD)
    with pytest.raises(ValueError, match="cannot be negative"):
        q.set("a", -1, 8 * RECORD)
    assert q.total() == 8 * RECORD
    s = open_store(str(tmp_path), {"a": 2, "b": 2})
    put(s, "b", range(8))
    s.quotas.set("a", 6 * RECORD, s.capacity)          # a's guarantee grows: b's borrowed records make room
    put(s, "a", range(6))
    assert held(s, "b", range(8)) == [6, 7] and len(held(s, "a", range(6))) == 6
    s.close()


def test_a_rewrite_cut_short_leaves_the_old_file_and_no_stray(tmp_path):
    d = str(tmp_path)
    s = open_store(d, {"a": 4, "b": 4})
    put(s, "a", range(2))
    s.close()
    with open(os.path.join(d, FILE + ".tmp"), "wb") as f:
        f.write(MAGIC)                                  # a rewrite that never reached its rename
    s = open_store(d, {"a": 4, "b": 4}, knows=False)
    assert s.quotas.rows([])["a"]["ssd_used_bytes"] == 2 * RECORD
    assert not os.path.exists(os.path.join(d, FILE + ".tmp")) and s.counters["skipped_files"] == 0
    s.close()


def test_a_write_with_no_room_under_the_quotas_is_refused_and_says_why(tmp_path, caplog):
    s = open_store(str(tmp_path), {"a": 4, "b": 4})
    put(s, "a", range(4))
    put(s, "b", range(4))                              # full, both at their quotas
    with caplog.at_level("WARNING", logger="kvstore"):
        assert put(s, "c", range(1)) == 0              # c has no quota and no record of this size: none of a's or b's
    assert s.counters["full"] == 1 and s.quotas.counters["quota_blocked"] == 1
    assert "every tenant holding blocks of this size is at or below its SSD quota" in caplog.text
    assert held(s, "a", range(4)) == [0, 1, 2, 3] and held(s, "b", range(4)) == [0, 1, 2, 3]
    s.close()

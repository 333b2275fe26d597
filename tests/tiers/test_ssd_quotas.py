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


def test_borrowers_give_back_their_least_recently_used_first(tmp_path):
    s = open_store(str(tmp_path), {"a": 4, "b": 1, "c": 1}, records=8)
    put(s, "c", range(2))                              # c 1 record over its quota
    put(s, "b", range(4))                              # b 3 over
    put(s, "a", range(2))                              # the tier is full (8 records)
    assert held(s, "b", range(4)) == [0, 1, 2, 3]      # b's blocks are read: c's are the least recently used
    put(s, "a", range(2, 4))                           # a within its quota takes c's oldest (c is then at its
    assert held(s, "c", range(2)) == [1]               # quota: no more of c's), then b's oldest
    assert held(s, "b", range(4)) == [1, 2, 3] and held(s, "a", range(4)) == [0, 1, 2, 3]
    put(s, "a", range(4, 5))                           # a over its quota too: among borrowers the least recently
    assert held(s, "a", range(5)) == [0, 1, 2, 3, 4]   # used goes, b's (a's were read after b's): memory follows
    assert held(s, "b", range(4)) == [2, 3]            # use among borrowers, as in the host pool
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


SMALL = 4096                                       # another model's blocks: a record of 8 KiB against 12 KiB
SMALL_RECORD = HEADER_BYTES + SMALL


def put_small(s: SsdStore, tenant: str, ids: range) -> int:
    return sum(s.put_many([(NS[tenant], key(i), data(tenant, i)[:SMALL])]) for i in ids)


def held_small(s: SsdStore, tenant: str, ids: range) -> list[int]:
    out = bytearray(SMALL)
    return [i for i in ids if s.get(NS[tenant], key(i), out) and bytes(out) == data(tenant, i)[:SMALL]]


def on_disk(d: str) -> int:
    """Bytes the record files really hold on the disk (holes excluded), less a 4 KiB block per file: a file with
    holes may take an extent block of the file system's (ext4), which is not a record's."""
    files = [f for f in os.listdir(d) if f.endswith(".kvs")]
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for f in files) - 4096 * len(files)


def test_a_quota_holds_across_block_sizes_borrowed_records_are_punched_out(tmp_path):
    d = str(tmp_path)
    s = open_store(d, {"a": 6, "b": 6}, records=12)   # 12 records of a's size: 18 of b's smaller ones
    assert put_small(s, "b", range(18)) == 18          # b (another model) fills the tier with its block size
    assert put(s, "a", range(6)) == 6                  # a within its quota: b's records punched out for a's file
    assert held_small(s, "b", range(18)) == list(range(9, 18))    # b keeps its quota's worth, its newest
    assert s.quotas.used["b"] == 9 * SMALL_RECORD == s.quotas.quota("b")
    assert s.counters["punched"] == 9 and s.allocated_bytes() <= s.capacity and on_disk(d) <= s.capacity
    assert put(s, "a", range(6, 8)) == 2               # a at its quota: it cycles its own, b is not touched
    assert held(s, "a", range(8)) == [2, 3, 4, 5, 6, 7] and held_small(s, "b", range(18)) == list(range(9, 18))
    assert s.file_bytes() > s.capacity                 # b's file keeps its size, with holes ...
    assert s.resize(s.capacity) == 0                   # ... which a resize counts as the space they gave back
    s.close()
    s = open_store(d, {"a": 6, "b": 6}, records=12, knows=False)   # restarted: the holes are free records now
    assert held(s, "a", range(8)) == [2, 3, 4, 5, 6, 7] and held_small(s, "b", range(18)) == list(range(9, 18))
    s.tenant_of = OWNER.get
    assert put_small(s, "b", range(100, 109)) == 9     # b writes again: into its holes, cycling its own
    assert on_disk(d) <= s.capacity and s.allocated_bytes() <= s.capacity
    assert len(held(s, "a", range(8))) == 6
    s.close()
    for f in os.listdir(d):                            # no trusted record map: a full scan books the free records
        if f.endswith(".map"):
            os.unlink(os.path.join(d, f))
    s = SsdStore(d, 12 * RECORD, quotas=SsdQuotas({"a": 6 * RECORD, "b": 6 * RECORD}))
    s.tenant_of = OWNER.get
    s.open(wait=False)                                 # serving while it scans: the holes are found at its end
    s.scanner.wait()
    assert s.scan.state == "ready" and len(held(s, "a", range(8))) == 6
    assert put_small(s, "b", range(200, 220)) == 20 and on_disk(d) <= s.capacity
    s.close()


def test_a_borrower_that_cannot_make_the_room_loses_no_record(tmp_path):
    """Sizes that do not tile: b's quota is 7.5 of its records, so it keeps 8 at least. With a at 6 records and
    the tier full, b is one record over its floor, and a's 7th needs one and a half: b gives nothing (before, it
    lost that record to a punch that made room for no one)."""
    s = open_store(str(tmp_path), {"a": 7, "b": 5}, records=12)   # b: 5 × 12 KiB = 7.5 records of 8 KiB
    assert put_small(s, "b", range(18)) == 18
    assert put(s, "a", range(6)) == 6                  # b's records punched out: 2, 1, 2, 1, 2, 1
    assert s.counters["punched"] == 9 and held_small(s, "b", range(18)) == list(range(9, 18))
    assert s.capacity - s.allocated_bytes() == 0
    assert put(s, "a", range(6, 7)) == 1               # within a's quota, but b can free 8 KiB of the 12 it needs
    assert s.counters["punched"] == 9 and held_small(s, "b", range(18)) == list(range(9, 18))
    assert held(s, "a", range(7)) == [1, 2, 3, 4, 5, 6]    # a cycled its own
    assert s.quotas.rows([])["b"]["ssd_used_bytes"] == 9 * SMALL_RECORD
    s.close()


def test_free_records_of_one_size_serve_another_without_quotas(tmp_path):
    d = str(tmp_path)
    s = open_store(d, None, records=12)
    assert put_small(s, "b", range(18)) == 18          # the whole tier in small records
    s.delete_many([NS["b"] + key(i) for i in range(18)])
    assert put(s, "a", range(12)) == 12                # before: no record of a's size to evict, so none stored
    assert held(s, "a", range(12)) == list(range(12)) and s.counters["evictions"] == 0
    assert s.counters["punched"] == 18 and on_disk(d) <= s.capacity
    s.close()


def test_a_tenant_name_too_long_to_keep_is_served_and_only_forgotten_at_a_restart(tmp_path):
    d = str(tmp_path)
    long = "é" * 64                                    # 64 characters, 128 bytes: fits; 4-byte characters do not
    longer = "\U0001F600" * 64
    s = open_store(d, {"a": 4, "b": 4})
    s.tenant_of = {NS["a"]: long, NS["b"]: longer}.get
    assert put(s, "a", range(2)) == 2 and put(s, "b", range(2)) == 2
    assert s.quotas.used[long] == s.quotas.used[longer] == 2 * RECORD
    s.tenant_of = OWNER.get
    put(s, "c", range(1))
    s.delete_many([NS["c"] + key(0)])                  # c's digest holds nothing at close: the file is rewritten
    s.close()
    owners, _ = parse(open(os.path.join(d, FILE), "rb").read())
    assert owners == {NS["a"]: long}

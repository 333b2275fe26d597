"""The records in the donated tier's books: regions carved into slots, and the blocks in them. Plain data: every
field is read and written under the tier's lock (kvstore.tiers.donated.books), never elsewhere.

A region serves one block size at a time: it is carved into slots of the first size booked in it, and may be
carved again for another size once it holds nothing (no block, no copy in flight). A slot is free when no block
owns it and no copy reads it (`pins`): a block deleted while a reader copies it frees its slot when that copy ends,
so a slot is never overwritten under a reader.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.tiers import StagingBuffer
from kvstore.tiers.donated.memory import RegionMemory


@dataclass(eq=False, slots=True)
class Handoff:
    """A block evicted from this tier to make room, whose bytes still wait in the slot its successor was booked
    into: the successor's `fill` copies them into `buf` (the next tier's staging buffer) before its own."""
    bid: bytes
    buf: StagingBuffer
    nbytes: int
    check: int              # the CRC its bytes were stored with here (the writer's, or computed at fill)


@dataclass(eq=False, slots=True)
class Block:
    bid: bytes
    region: Region
    slot: int
    nbytes: int
    crc: int | None                         # its writer's CRC-32C (None: the writer gave none); reads hand it back
    check: int = 0                          # what reads verify against: the writer's CRC, or that of the fill's copy
    ready: bool = False                     # filled: readable
    ticket: StagingBuffer | None = None     # while booked and not filled: what `stage` handed out
    handoff: Handoff | None = None

    @property
    def offset(self) -> int:
        return self.slot * self.region.slot_bytes


@dataclass(eq=False, slots=True)
class Region:
    id: int
    name: str
    mem: RegionMemory
    owner: int                               # the donor connection's id
    slot_bytes: int = 0                      # 0: not carved yet
    owners: list[Block | None] = field(default_factory=list)
    pins: list[int] = field(default_factory=list)
    free: list[int] = field(default_factory=list)
    used: int = 0                            # slots owned by a block (booked or filled)
    pinned: int = 0                          # pins on all slots
    users: int = 0                           # copies touching the memory now: an unmap waits for none
    closing: bool = False                    # being reclaimed: nothing new is booked in it
    dead: bool = False                       # its donor is gone: nothing is read from it any more
    gone: bool = False                       # unmapped (or about to be): nothing touches it

    @property
    def size(self) -> int:
        return self.mem.size

    @property
    def open(self) -> bool:
        return not (self.closing or self.gone)

    def carvable(self, nbytes: int) -> bool:
        """Empty, and big enough for one slot of `nbytes`."""
        return self.open and self.used == 0 and self.pinned == 0 and self.size >= nbytes

    def carve(self, slot_bytes: int) -> None:
        n = self.size // slot_bytes
        self.slot_bytes = slot_bytes
        self.owners = [None] * n
        self.pins = [0] * n
        self.free = list(range(n - 1, -1, -1))      # slot 0 first

    def take(self, slot: int, blk: Block) -> None:
        self.owners[slot] = blk
        self.used += 1

    def release(self, slot: int) -> None:
        """The slot's block is gone; the slot is free once no copy reads it."""
        self.owners[slot] = None
        self.used -= 1
        if self.pins[slot] == 0:
            self.free.append(slot)

    def pin(self, slot: int) -> None:
        self.pins[slot] += 1
        self.pinned += 1
        self.users += 1

    def unpin(self, slot: int) -> None:
        self.pins[slot] -= 1
        self.pinned -= 1
        self.users -= 1
        if self.pins[slot] == 0 and self.owners[slot] is None:
            self.free.append(slot)

    def describe(self) -> dict[str, object]:
        return {"id": self.id, "name": self.name, "kind": self.mem.kind, "bytes": self.size,
                "slot_bytes": self.slot_bytes, "slots": len(self.owners), "used": self.used,
                "closing": self.closing, "dead": self.dead}

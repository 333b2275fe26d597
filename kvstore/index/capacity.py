"""The host pool's capacity books: which slot a new block gets, which block leaves when there is none, and which
segments go when the pool shrinks. Decisions only: the pool (kvstore.tiers.host) owns the memory, the policy
(kvstore.policy) ranks the candidates, and each evicted block is handed, as an `Eviction`, to the sink the daemon
gave (the demotion mover), which may hold its slot until it has copied the bytes.

Three parts, over the shared books (kvstore.index.state), composed by `kvstore.index.books.Index`:

- `allocation.Allocation`: a slot within the cap for a new block — a victim's slot, a segment of another class or
  tenant taken over (compacted first where it changes tenants), or "no space".
- `removal.Removal`: blocks leaving the pool and the slots they free — pins and last releases, evictions handed
  to the sink, retiring segments (lent, or emptied inline) and their drain steps.
- `trim.Trim`: the operator's eviction, a chunk at a time, and resize.

Here: what they hand out and take in (`Eviction`, `EvictionSink`, `EvictPlan`, `ResizeResult`) and their sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvstore.index.namespaces import NamespaceEntry
    from kvstore.index.sweep import SlotCursor

MOVE_CHUNK = 256        # blocks of a lent segment evicted per drain step (a few milliseconds under the lock)

STALE_SAMPLE = 64       # slots a same-tenant segment move looks at to judge a segment stale (`_mostly_stale`)


@dataclass(frozen=True, slots=True)
class Eviction:
    """A block leaving the host pool, as the books decided it."""
    block_id: bytes         # namespace digest + block hash: its name in the lower tiers
    gid: int                # the slot it occupied
    nbytes: int
    handed_over: bool       # the slot goes to the evicting caller, who writes it only after the sink copied it
    draining: bool          # the slot's segment is being released
    copy_now: bool = False  # ... under the lock, for an allocation that waits for it: no copy may be deferred


class EvictionSink(Protocol):
    def __call__(self, e: Eviction) -> bool:
        """(Under the state lock.) Take note of an eviction; True to hold the slot (pinned) until `let_go`."""
        ...


@dataclass(slots=True)
class EvictPlan:
    """An operator's eviction, made a chunk at a time (`Trim.evict_some`): of one namespace (a walk over its slots)
    or in the policy's order per class; until `nbytes` are freed or, with `everything`, all of them."""
    nbytes: int
    everything: bool
    ns: NamespaceEntry | None = None
    cursor: SlotCursor | None = None
    left: int = 0               # policy order: at most the blocks there were at the start (writers go on meanwhile)
    blocks: int = 0
    freed: int = 0
    done: bool = False

    def wants(self) -> bool:
        return self.everything or self.freed < self.nbytes


@dataclass(slots=True)
class ResizeResult:
    capacity: int
    released_segments: int
    evicted: int
    draining_bytes: int
    seconds: float

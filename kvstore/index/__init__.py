"""The index: the daemon's books. Which key lives in which host slot, who pins or reserves it, which namespaces
exist, and — as decisions handed to movers — which blocks leave the host pool. It moves no byte.

- `books.Index`: the face of the books, composing its parts over the shared books (`state`): the request side
  (`stores`: two-phase stores, promotions, deletes; `reads`: lookups, pins, walks) and the capacity side
  (`capacity`: its types and overview; `allocation`, `removal`: eviction, frees, drain steps; `trim`: resize).
- `namespaces`: the registry (index keys are namespace id + block hash, 20 bytes) and each connection's holdings.
- `sharing`: share groups (one geometry per declared group), base/residual pairs and forks (ForkKV).
- `keytable`: the key → slot table with intrusive LRU lists (native, with a pure-Python fallback).
- `sweep`: walks over one namespace's slots, a chunk at a time (an operator's `list` and `evict`).
- `errors`: what the books refuse; the daemon turns each into a protocol status.
"""
from kvstore.index.books import Index
from kvstore.index.capacity import Eviction, EvictionSink, EvictPlan, ResizeResult
from kvstore.index.errors import InvalidRequest, NotHeld, OverLimit, Refused, TooLarge, UnknownNamespace
from kvstore.index.namespaces import HoldGroup, Holdings, NamespaceEntry
from kvstore.index.sharing import GroupMismatch, NotAPair
from kvstore.index.sweep import SlotCursor

__all__ = ["EvictPlan", "Eviction", "EvictionSink", "GroupMismatch", "HoldGroup", "Holdings", "Index",
           "InvalidRequest", "NamespaceEntry", "NotAPair", "NotHeld", "OverLimit", "Refused", "ResizeResult",
           "SlotCursor", "TooLarge", "UnknownNamespace"]

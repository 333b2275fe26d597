"""The remote tier: blocks shared by the daemons of several nodes through Mooncake Store (DESIGN.md, "Tiers").

kvstore runs no server of its own here: Mooncake's master keeps the books of the store, and every daemon's
transfer engine contributes a segment of memory (`remote.segment_bytes`) in which the store places values, its own
or another node's. A block's key is its id — namespace digest + block hash — so daemons of different nodes that
share a namespace find each other's blocks and nothing else (client.store_key); its value is the block's bytes
followed by a 16-byte trailer carrying the writer's CRC-32C (trailer.py), checked by every reader.

- `client`: the Mooncake calls, with plain return values and one exception (StoreDown).
- `arena`: registered memory handed out as a ring (write-back staging; the trailers of transfers in flight).
- `tier`: the `LowerTier` (and `SharedTier`), a facade over its parts: `wire` (what they share: one lock, the
  registered memory, the counters), `link` (faults: a store that does not answer is a miss, and the tier
  reconnects by itself), `books` (what the store is known to hold), `writeback` (staged evictions and their
  writer), `puts` (write-through, and puts in pieces), `reads` (into host slots with no bounce copy, each block
  verified) and `admin` (deletes, stats, the stop).
"""

"""Donated memory as a tier (SwiftCache §3.2): processes with idle memory (an engine whose KV cache is half empty)
lend the daemon a region and take it back on demand; the daemon keeps evicted blocks there, between the host pool
and the SSD, and moves them down (or drops them) when the region is reclaimed, within the donor's deadline.

- `tier`: `DonatedTier`, a `LowerTier` (stage/fill/read/...; reclaim) and `open_tier`, composing its parts:
  `books` (the books and the tier's one lock), `staging` (stage, fill, write), `down` (blocks handed to the tier
  below), `reads` (read, read_async) and `reclaim` (a donor taking a region back);
- `listener`: the donors' Unix socket (donate, reclaim; a donor that disconnects is reclaimed at once);
- `region`: the records in the books — regions carved into slots of one block size, and the blocks in them;
- `memory`: a region's memory: a shared memfd (every machine), or `cuda` (GPU memory by CUDA IPC handle, imported
  only for a region of that kind; untested);
- `config`: the `donated:` configuration section.
The donor's side is `kvstore.client.donor`.
"""

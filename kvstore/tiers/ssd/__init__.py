"""The SSD tier: Full Blocks in checksummed records on local disk, found again after a restart.

- `tier`: what the daemon uses, a `LowerTier` (built by `open_tier` from the `ssd` configuration section): the
  facade — verified reads, deletes, resize, tenants' books, stats — composing `staging` (the staging area of evicted
  blocks, and the write-through hooks that make them urgent) and `demoter` (the demotion writer thread, and the
  write batches it shares with write-through);
- `store`: the record store's books (key → record, LRU order, per-namespace counts, eviction classes), composing
  `files` (the record files of one block size, the directory lock, growth), `scan` (the restart scan, while the
  daemon serves), `writes` (placement at the cap, payload then header, sync policy), `reads` (verified reads),
  `zeroing` (records wiped before reuse), `room` (eviction and punching at the cap, SSD quotas) and `removal`
  (durable deletes, resize);
- `record`: the record format and its one check; `uring` (with `uring_probe`, over native/kvuring.c): io_uring
  where it works, else threads.
"""

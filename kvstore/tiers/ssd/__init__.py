"""The SSD tier: Full Blocks in checksummed records on local disk, found again after a restart.

- `tier`: what the daemon uses, a `LowerTier`: staging of evicted blocks, demotion and write-through writes,
  verified reads (built by `open_tier` from the `ssd` configuration section);
- `store`: the record store's books (key → record, LRU order, per-namespace counts, delete, resize), composing
  `files` (the record files of one block size, the directory lock, growth), `scan` (the restart scan, while the
  daemon serves), `writes` (placement at the cap, payload then header, sync policy) and `reads` (verified reads);
- `record`: the record format and its one check; `uring` (with `uring_probe`): io_uring where it works, else
  threads.
"""

"""The SSD tier: `tier` (what the daemon uses: staging of evicted blocks, demotion writes, verified reads), over
`store` (checksummed records in preallocated files, scanned back at start) in the `record` format, moved by
threads or `uring`."""

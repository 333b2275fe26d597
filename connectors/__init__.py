"""kvstore.connectors: thin engine connectors (installed under kvstore's name from the top-level connectors/ folder).

- `vllm_connector` (KVConnectorBase_V1; `vllm_plugin` registers it as "KVStoreConnector"): a facade over
  `vllm_scheduler` (lookups, what to load and save, hints) and `vllm_worker` (KV pages, layer by layer), with
  `vllm_common` (the metadata between them, the extra config) and `vllm_layout`;
- `sglang_backend` (a HiCache storage backend), `sglang_patches` (CPU workarounds for tests);
- `daemon_link`: the connection both keep, which turns a daemon that is away into misses, never an engine error;
- `kv_pages` and `cuda_copy`: KV pages ⇄ shared slots, on CPU or GPU.
A connector maps engine hashes to block hashes and KV pages to slots; it caches nothing of its own. Each imports
only the client side of kvstore (never the daemon), and its engine only where it needs it.
"""

"""kvstore: a per-node KV-cache storage and transfer daemon for LLM inference engines.

The tree follows the data path. An engine process imports `kvstore.client` (and `kvstore.connectors`), which share
only `kvstore.protocol` with the daemon. In the daemon a request enters `daemon` (server, session, ops), is checked
against `protocol`, booked by `index`, decided by `policy`, carried out by `movers` through `traffic`, and its bytes
live in a tier of `tiers` (host pool, SSD, ...).

`import kvstore` is light: it never imports torch, CUDA, an engine or the daemon.
"""
from kvstore.protocol.geometry import Geometry
from kvstore.protocol.keys import NamespaceSpec, chain_hashes

__version__ = "0.1.0"
__all__ = ["Geometry", "NamespaceSpec", "__version__", "chain_hashes"]


def __getattr__(name: str) -> object:
    # The client is imported on first use so that `import kvstore` stays cheap.
    if name in ("Client", "Namespace", "KVStoreError"):
        from kvstore import client

        return getattr(client, name)
    if name == "AsyncClient":
        from kvstore.client.aio import AsyncClient

        return AsyncClient
    raise AttributeError(name)

"""kvstore: a per-node KV-cache storage and transfer daemon for LLM inference engines.

`import kvstore` is light: it never imports torch, CUDA or an engine.
"""
from kvstore.geometry import Geometry
from kvstore.keys import NamespaceSpec, chain_hashes

__version__ = "0.1.0"
__all__ = ["Geometry", "NamespaceSpec", "__version__", "chain_hashes"]


def __getattr__(name: str) -> object:
    # The client is imported on first use so that `import kvstore` stays cheap.
    if name in ("Client", "Namespace", "KVStoreError"):
        from kvstore import client

        return getattr(client, name)
    if name == "AsyncClient":
        from kvstore.aio import AsyncClient

        return AsyncClient
    raise AttributeError(name)

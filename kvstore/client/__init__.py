"""The client: what an engine process imports, and nothing of the daemon.

`Client` holds one connection to the local daemon and maps the host pool's segments it is handed; `Namespace` moves
one namespace's blocks (put, get, lookup, prefetch, delete) with one copy between a caller's buffer and a shared
slot; `Reservation` and `Lease` are the two-phase pieces under them (layer by layer for engines); `AsyncClient`
(`kvstore.client.aio`) is the same for asyncio. A refusal raises `KVStoreError` with the protocol's code. Hints
(`Client.workflow`, `Client.session`, a request's `Context`) are in `kvstore.client.hints`. A `Pair` (`Client.pair`,
`kvstore.client.pairs`) is a base namespace and an adapter's residual one (ForkKV), looked up and acquired together.
Inside: `Client` is one object built in layers (`wire`, `segments`, `admin`, then `connection`: its docstring says
which owns what); a namespace's blocks are `blocks` (Namespace), `reservation` (writes) and `lease` (reads).
"""
from kvstore.client.blocks import Lease, Namespace, PutResult, Reservation, StreamLease
from kvstore.client.connection import Client, KVStoreError
from kvstore.client.hints import Context, SessionHandle, WorkflowHandle
from kvstore.client.pairs import ForkView, Pair, PairHit

__all__ = ["Client", "Context", "ForkView", "KVStoreError", "Lease", "Namespace", "Pair", "PairHit", "PutResult",
           "Reservation", "SessionHandle", "StreamLease", "WorkflowHandle"]

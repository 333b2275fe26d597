"""The asyncio flavour of the client: the same operations as awaitables.

Each AsyncClient owns one sync Client and one worker thread; its calls run there in order, so the event loop never
waits on the socket or on a copy (numpy copies release the GIL), and a connection is never used by two threads.
Hints: `ac.workflow(wid, type)` and `ac.session(sid)` are handles (not awaited) whose methods are awaitables that
never raise for a hint the daemon does not take (kvstore.client.hints).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from kvstore.client import Client, ForkView, Namespace, Pair, PairHit, PutResult
from kvstore.client.hints import Context, ContextLike, SessionHandle, WorkflowHandle
from kvstore.protocol.keys import NamespaceSpec

T = TypeVar("T")


class AsyncClient:
    def __init__(self, path: str | None = None, copy_threads: int = 1) -> None:
        self._path = path
        self._copy_threads = copy_threads
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvstore-aio")
        self._client: Client | None = None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def connect(self) -> AsyncClient:
        self._client = await self._run(Client, self._path, self._copy_threads)
        return self

    @property
    def client(self) -> Client:
        if self._client is None:
            raise RuntimeError("AsyncClient is not connected: use `async with AsyncClient(...)` or `await connect()`")
        return self._client

    async def namespace(self, spec: NamespaceSpec) -> AsyncNamespace:
        return AsyncNamespace(self, await self._run(self.client.namespace, spec))

    async def pair(self, base: NamespaceSpec, residual: NamespaceSpec) -> AsyncPair:
        """Client.pair: a base namespace and one adapter's residual namespace (ForkKV)."""
        return AsyncPair(self, await self._run(self.client.pair, base, residual))

    async def ping(self) -> dict[str, Any]:
        return await self._run(self.client.ping)

    async def stats(self) -> dict[str, Any]:
        return await self._run(self.client.stats)

    async def resize(self, nbytes: int) -> dict[str, Any]:
        return await self._run(self.client.resize, nbytes)

    async def hint(self, kind: str, **fields: Any) -> dict[str, Any]:
        """The raw hint op (Client.hint): raises KVStoreError on a malformed hint."""
        return await self._run(partial(self.client.hint, kind, **fields))

    def workflow(self, wid: str, type: str | None = None) -> AsyncWorkflow:
        return AsyncWorkflow(self, WorkflowHandle(self.client, wid, type))

    def session(self, sid: str) -> AsyncSession:
        return AsyncSession(self, SessionHandle(self.client, sid))

    async def workflows(self, limit: int = 100) -> list[dict[str, Any]]:
        return await self._run(self.client.workflows, limit)

    async def flush_durable(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Wait until every block of this client's tenant stored before now is on disk (Client.flush_durable)."""
        return await self._run(self.client.flush_durable, timeout_s)

    async def close(self) -> None:
        if self._client is not None:
            await self._run(self._client.close)
            self._client = None
        self._executor.shutdown(wait=False)

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncNamespace:
    def __init__(self, owner: AsyncClient, ns: Namespace) -> None:
        self._owner = owner
        self.sync = ns
        self.id = ns.id

    async def lookup(self, hashes: Sequence[bytes], context: ContextLike = None) -> int:
        return await self._owner._run(self.sync.lookup, hashes, context)

    async def held(self, hashes: Sequence[bytes], context: ContextLike = None) -> list[bool]:
        return await self._owner._run(self.sync.held, hashes, context)

    async def put(self, hashes: Sequence[bytes], blocks: Sequence[Any], batch: int = 32, durable: bool = False,
                  durable_timeout_s: float | None = None, context: ContextLike = None,
                  after: Sequence[bytes] = ()) -> PutResult:
        """Namespace.put; with `durable`, the awaitable completes once the blocks are on disk (or at the
        deadline), without blocking the event loop meanwhile."""
        return await self._owner._run(partial(self.sync.put, hashes, blocks, batch, durable=durable,
                                              durable_timeout_s=durable_timeout_s, context=context, after=after))

    async def wait_durable(self, hashes: Sequence[bytes], timeout_s: float | None = None) -> dict[str, Any]:
        return await self._owner._run(self.sync.wait_durable, hashes, timeout_s)

    async def get(self, hashes: Sequence[bytes], outs: Sequence[Any], batch: int = 32,
                  context: ContextLike = None) -> int:
        return await self._owner._run(partial(self.sync.get, hashes, outs, batch, context=context))

    async def delete(self, hashes: Sequence[bytes]) -> int:
        return await self._owner._run(self.sync.delete, hashes)


class AsyncPair:
    """kvstore.client.pairs.Pair as awaitables; its parts are AsyncNamespaces (`base`, `residual`)."""

    def __init__(self, owner: AsyncClient, pair: Pair) -> None:
        self._owner = owner
        self.sync = pair
        self.base = AsyncNamespace(owner, pair.base)
        self.residual = AsyncNamespace(owner, pair.residual)

    async def lookup(self, hashes: Sequence[bytes], context: ContextLike = None) -> PairHit:
        return await self._owner._run(self.sync.lookup, hashes, context)

    async def get(self, hashes: Sequence[bytes], base_outs: Sequence[Any], residual_outs: Sequence[Any],
                  batch: int = 32, context: ContextLike = None) -> tuple[int, int]:
        return await self._owner._run(partial(self.sync.get, hashes, base_outs, residual_outs, batch,
                                              context=context))

    async def fork(self, hashes: Sequence[bytes], parent: AsyncNamespace | None = None) -> ForkView:
        return await self._owner._run(self.sync.fork, hashes, parent.sync if parent is not None else None)


class AsyncWorkflow:
    """A workflow's hints as awaitables (kvstore.client.hints.WorkflowHandle); `async with` begins and ends it."""

    def __init__(self, owner: AsyncClient, handle: WorkflowHandle) -> None:
        self._owner = owner
        self.sync = handle

    async def begin(self) -> dict[str, Any]:
        return await self._owner._run(self.sync.begin)

    async def call(self, agent: str, step: int | None = None, next: list[str] | None = None,
                   priority: int | str | None = None) -> dict[str, Any]:
        return await self._owner._run(partial(self.sync.call, agent, step, next, priority))

    async def end(self) -> dict[str, Any]:
        return await self._owner._run(self.sync.end)

    def context(self, agent: str = "") -> Context:
        return self.sync.context(agent)

    async def __aenter__(self) -> AsyncWorkflow:
        await self.begin()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.end()


class AsyncSession:
    """A chat session's hints as awaitables (kvstore.client.hints.SessionHandle)."""

    def __init__(self, owner: AsyncClient, handle: SessionHandle) -> None:
        self._owner = owner
        self.sync = handle

    async def begin(self) -> dict[str, Any]:
        return await self._owner._run(self.sync.begin)

    async def turn(self, agent: str = "", priority: int | str | None = None) -> dict[str, Any]:
        return await self._owner._run(self.sync.turn, agent, priority)

    async def end(self) -> dict[str, Any]:
        return await self._owner._run(self.sync.end)

    def context(self, agent: str = "") -> Context:
        return self.sync.context(agent)

    async def __aenter__(self) -> AsyncSession:
        await self.begin()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.end()

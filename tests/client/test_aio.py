"""The asyncio client against a real daemon: several coroutines at once, byte-exact."""
from __future__ import annotations

import asyncio

from kvstore.client.aio import AsyncClient
from tests.conftest import GEOM, block, hashes, spec


async def test_async_clients_roundtrip_concurrently(daemon):
    async def worker(seed: int) -> list[bytes]:
        async with AsyncClient(daemon.socket) as c:
            ns = await c.namespace(spec())
            hs = hashes(16, start=seed * 100)
            r = await ns.put(hs, [block(seed * 100 + i) for i in range(16)])
            assert r.stored == 16
            assert await ns.lookup(hs) == 16
            outs = [bytearray(GEOM.full_bytes) for _ in hs]
            assert await ns.get(hs, outs) == 16
            return [bytes(o) for o in outs]

    results = await asyncio.gather(*(worker(s) for s in range(4)))
    for seed, outs in enumerate(results):
        assert outs == [block(seed * 100 + i) for i in range(16)]
    async with AsyncClient(daemon.socket) as c:
        assert (await c.stats())["blocks"] == 64

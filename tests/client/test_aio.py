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
            assert await ns.held([hs[0], hashes(1, start=999_999)[0]]) == [True, False]
            outs = [bytearray(GEOM.full_bytes) for _ in hs]
            assert await ns.get(hs, outs) == 16
            return [bytes(o) for o in outs]

    results = await asyncio.gather(*(worker(s) for s in range(4)))
    for seed, outs in enumerate(results):
        assert outs == [block(seed * 100 + i) for i in range(16)]
    async with AsyncClient(daemon.socket) as c:
        assert (await c.stats())["blocks"] == 64


async def test_an_async_pair_forks_puts_and_reads_both_parts(daemon):
    from kvstore.protocol.geometry import Geometry
    res_geom = Geometry(layers=GEOM.layers, tokens=GEOM.tokens, kv_heads=1, head_dim=8, dtype="float16")
    base_spec = spec("llama", group="lora")
    hs = hashes(4, tag=b"aio-pair")
    async with AsyncClient(daemon.socket) as c:
        first = await c.pair(base_spec, spec("llama", res_geom, group="lora", adapter="a", role="residual"))
        await first.base.put(hs, [block(i) for i in range(4)])
        second = await c.pair(base_spec, spec("llama", res_geom, group="lora", adapter="b", role="residual"))
        view = await second.fork(hs, parent=first.residual)
        assert (view.base, view.residual, view.parent) == (4, 0, 0)
        await second.residual.put(hs[:3], [block(50 + i, res_geom.full_bytes) for i in range(3)])
        hit = await second.lookup(hs)
        assert (hit.base, hit.residual) == (4, 3)
        bouts = [bytearray(GEOM.full_bytes) for _ in hs]
        routs = [bytearray(res_geom.full_bytes) for _ in hs]
        assert await second.get(hs, bouts, routs) == (4, 3)
    assert [bytes(o) for o in bouts] == [block(i) for i in range(4)]
    assert [bytes(o) for o in routs[:3]] == [block(50 + i, res_geom.full_bytes) for i in range(3)]

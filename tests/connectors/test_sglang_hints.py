"""The SGLang backend's hints (connectors/sglang_backend.py, issue 14 part 1): where a HiCache storage call's
`extra_info` carries request information in its `extra_info` dict (SGLang's cache linker names a `session_id`; a
framework may send our fields), the call's blocks get that context, and the first call naming a (workflow, agent)
pair begins it in the daemon. SGLang 0.5.23's own HiCache calls carry `prefix_keys` only: no context, as before.
Real SGLang pool classes on the CPU and a real daemon running the workflow policy; runs in .venv-sglang."""
from __future__ import annotations

import pytest

from tests.engine_guard import engine_missing

pytestmark = pytest.mark.sglang

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
except Exception as e:  # noqa: BLE001 - any import failure means: no SGLang here
    engine_missing("sglang", e)

from tests.connectors.test_sglang_connector import PAGE, backend, fill, keys, mha_host  # noqa: E402 - needs SGLang


def test_extra_info_gives_the_pages_a_context_and_begins_its_session(start_daemon):
    daemon = start_daemon(env={"KVSTORE_POOL_EVICTION": "workflow"})
    host = mha_host("layer_first")
    b = backend(daemon, host)
    fill(host, 3)
    ks, src = keys(4, "hint"), host.alloc(4 * PAGE)
    plain = HiCacheStorageExtraInfo(prefix_keys=[])                         # what SGLang 0.5.23 itself passes
    chat = HiCacheStorageExtraInfo(prefix_keys=ks[:2], extra_info={"session_id": "chat-1"})
    assert b.batch_set_v1(ks[:2], src[:2 * PAGE], plain) == [True] * 2
    assert b.batch_set_v1(ks[2:], src[2 * PAGE:], chat) == [True] * 2
    with daemon.client() as c:
        books = c.stats()["workflows"]
        assert books["active"] == 1 and books["ignored"] == {}
        assert books["blocks"] == {"retired": 2, "active": 2}              # only the session's pages are its
        assert [r["workflow"] for r in c.call("workflows")["workflows"]] == ["session:chat-1"]
    # a framework's own fields; a later call of the same pair sends no second `call`
    coder = HiCacheStorageExtraInfo(extra_info={"workflow": "w9", "workflow_type": "pipeline", "agent": "coder"})
    assert b.batch_exists(ks, coder) == 4
    assert b.batch_get_v1(ks, host.alloc(4 * PAGE), coder) == [True] * 4  # read by w9: its blocks now
    assert b.batch_exists(ks, coder) == 4
    with daemon.client() as c:
        rows = {r["workflow"]: r for r in c.call("workflows")["workflows"]}
        assert rows["w9"]["type"] == "pipeline" and rows["w9"]["agent"] == "coder" and rows["w9"]["steps"] == 1
        books = c.stats()["workflows"]
        assert books["blocks"] == {"retired": 0, "active": 4} and books["ignored"] == {}
    b.close()

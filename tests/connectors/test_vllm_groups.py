"""The vLLM connector's reading of an engine's KV cache groups, against vLLM's own spec and config classes: which
groups it stores under which rule and namespace, and which models it refuses (no hit, one log line, never a wrong
restore) — including the recurrent-state layouts no CPU build runs here (issue 35)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from tests.engine_guard import engine_missing

pytestmark = pytest.mark.vllm

try:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )
except Exception as e:  # noqa: BLE001 - any import failure means: no engine here
    engine_missing("vllm", e)

from kvstore.connectors.kv_groups import FULL, STATE, WINDOW  # noqa: E402
from kvstore.connectors.vllm_common import parse_config  # noqa: E402
from kvstore.connectors.vllm_layout import engine_identity, make_spec  # noqa: E402
from kvstore.connectors.vllm_scheduler import KVStoreConnectorScheduler  # noqa: E402

BLOCK = 32


def engine_config(block: int = BLOCK) -> SimpleNamespace:
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block, prefix_caching_hash_algo="sha256_cbor", cache_dtype="auto",
                                     kv_cache_layout=None),
        device_config=SimpleNamespace(device_type="cpu"),
        model_config=SimpleNamespace(model="tiny-hybrid", revision=None),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))


def attention(block: int = BLOCK) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=32, dtype=torch.float32)


def sliding(window: int, block: int = BLOCK) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block, num_kv_heads=2, head_size=32, dtype=torch.float32,
                             sliding_window=window)


def mamba(mode: str = "align", block: int = BLOCK, padded: int | None = None) -> MambaSpec:
    return MambaSpec(block_size=block, shapes=((3, 288), (8, 32, 16)), dtypes=(torch.float32, torch.float32),
                     mamba_cache_mode=mode, page_size_padded=padded)


def kv_config(*specs, hash_block: int = BLOCK) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"model.layers.{2 * i + j}.attn" for j in range(2)], spec)
              for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups, hash_block_size=hash_block)


def test_a_sliding_window_model_is_two_groups_in_two_namespaces():
    groups, fields = engine_identity(engine_config(), kv_config(sliding(1024), attention()), {})
    assert [(g.rule.kind, g.rule.window_blocks, g.label) for g in groups] == \
        [(WINDOW, 32, "0:window1024"), (FULL, 0, "1:full")]
    specs = [make_spec(g, fields, 0, "") for g in groups]
    assert specs[0].digest() != specs[1].digest()
    assert specs[0].salt.endswith("|kv_group=0:window1024")


def test_a_dense_model_keeps_its_namespace_as_it_was():
    (group,), fields = engine_identity(engine_config(), kv_config(attention()), {"salt": "x"})
    assert group.label == "" and "kv_group" not in make_spec(group, fields, 0, "").salt


def test_a_mamba_state_is_stored_as_its_bytes_not_its_padding():
    groups, _ = engine_identity(engine_config(), kv_config(mamba(padded=32768), attention()), {})
    state = groups[0]
    assert (state.rule.kind, state.label) == (STATE, "0:state")
    assert state.geometry.layer_bytes == (3 * 288 + 8 * 32 * 16) * 4        # 19840, not the 32768 padded page
    assert state.geometry.layers == 2


@pytest.mark.parametrize(("specs", "why"), [
    ((mamba("none"), attention()), "mamba_cache_mode 'none'"),
    ((ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32,
                                attention_chunk_size=64), attention()), "ChunkedLocalAttentionSpec"),
    ((sliding(64, block=64), attention(64)), "blocks of 64 tokens, the block hashes 32"),
])
def test_a_model_kvstore_cannot_restore_exactly_gets_no_hit_and_one_line(specs, why, caplog):
    vllm_config = engine_config()
    ktc = SimpleNamespace(kv_connector_extra_config={"socket": "/nonexistent"}, kv_load_failure_policy="recompute")
    with caplog.at_level(logging.WARNING, logger="vllm.kvstore"):
        side = KVStoreConnectorScheduler(parse_config(ktc, vllm_config, True), vllm_config, kv_config(*specs))
    assert side.disabled is not None and why in side.disabled
    assert [r.getMessage() for r in caplog.records if "disabled" in r.getMessage()] == \
        [f"kvstore connector disabled: {side.disabled}"]
    request = SimpleNamespace(request_id="r", num_tokens=500, block_hashes=[bytes(32)] * 15)
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)


def request_of(n_blocks: int, tokens: int) -> SimpleNamespace:
    hashes = [bytes([i + 1]) * 32 for i in range(n_blocks)]
    return SimpleNamespace(request_id="r", num_tokens=tokens, block_hashes=hashes, kv_transfer_params=None,
                           lora_request=None)


def store(side: KVStoreConnectorScheduler, part: int, request: SimpleNamespace, positions: list[int]) -> None:
    from kvstore.protocol.keys import block_key

    ns = side.link.namespace("", part)
    nbytes = side.groups[part].geometry.full_bytes
    assert ns.put([block_key(request.block_hashes[p]) for p in positions],
                  [bytes([p]) * nbytes for p in positions]).stored == len(positions)


def test_the_scheduler_answers_the_longest_end_every_group_restores(daemon):
    """Against a real daemon: full attention holds 20 blocks, the window group (2 blocks a window) the windows
    before blocks 8 and 16: the hit ends at 16 (at 8 once the later window is gone), past the engine's local hit."""
    vllm_config = engine_config()
    ktc = SimpleNamespace(kv_connector_extra_config={"socket": daemon.socket}, kv_load_failure_policy="recompute")
    side = KVStoreConnectorScheduler(parse_config(ktc, vllm_config, True), vllm_config,
                                     kv_config(sliding(64), attention()))
    request = request_of(20, 20 * BLOCK + 5)
    store(side, 1, request, list(range(20)))
    store(side, 0, request, [6, 7, 14, 15])
    assert side.get_num_new_matched_tokens(request, 0) == (16 * BLOCK, True)      # hybrid: loaded asynchronously
    assert side.get_num_new_matched_tokens(request, 8 * BLOCK) == (8 * BLOCK, True)
    assert side.link.namespace("", 0).delete([side._hashes(request, 14, 16)[0]]) == 1
    assert side.get_num_new_matched_tokens(request, 0) == (8 * BLOCK, True)
    assert side.get_num_new_matched_tokens(request, 8 * BLOCK) == (0, False)      # nothing past the local hit


def test_a_model_without_full_attention_is_answered_from_its_other_groups(daemon):
    vllm_config = engine_config()
    ktc = SimpleNamespace(kv_connector_extra_config={"socket": daemon.socket}, kv_load_failure_policy="recompute")
    side = KVStoreConnectorScheduler(parse_config(ktc, vllm_config, True), vllm_config,
                                     kv_config(sliding(64), mamba()))
    request = request_of(12, 12 * BLOCK + 1)
    store(side, 0, request, [8, 9])          # the window before block 10
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)              # no state there
    store(side, 1, request, [9])             # the state after block 9
    assert side.get_num_new_matched_tokens(request, 0) == (10 * BLOCK, True)


def test_a_negative_window_checkpoint_is_refused_with_one_line_and_none_used(caplog):
    ktc = SimpleNamespace(kv_connector_extra_config={"window_checkpoint_blocks": -4},
                          kv_load_failure_policy="recompute")
    with caplog.at_level(logging.WARNING, logger="vllm.kvstore"):
        config = parse_config(ktc, engine_config(), True)
    assert config.window_checkpoint_blocks == 0
    assert [r.getMessage() for r in caplog.records] == \
        ["kvstore: window_checkpoint_blocks -4 is negative; using 0 (none)"]
    ktc.kv_connector_extra_config["window_checkpoint_blocks"] = 16
    assert parse_config(ktc, engine_config(), True).window_checkpoint_blocks == 16

"""vLLM general plugin: registers kvstore's connector under the name `KVStoreConnector`, so that

    --kv-transfer-config '{"kv_connector": "KVStoreConnector", "kv_role": "kv_both"}'

works with no `kv_connector_module_path`. The wheel declares it in the entry point group `vllm.general_plugins`
(pyproject.toml); vLLM's `load_general_plugins()` calls `register()` once per process (the API front end, the
engine core and every worker; `VLLM_PLUGINS` may name the plugins to load, kvstore's is called `kvstore`).

Light on purpose: it imports vLLM's connector factory (a module vLLM itself loads for any connector) and nothing of
kvstore's connector; the factory imports `kvstore.connectors.vllm_connector` only when an engine asks for the name.
Calling `register()` again, in the same process or after another registration of the same name, changes nothing.
"""
from __future__ import annotations

import logging

NAME = "KVStoreConnector"
MODULE = "kvstore.connectors.vllm_connector"
CLASS = "KVStoreConnector"

log = logging.getLogger("vllm.kvstore")


def register() -> None:
    """Register `KVStoreConnector` with vLLM's KVConnectorFactory (idempotent)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError as e:  # a vLLM without the V1 connector factory: the module path still works, if anything
        log.warning("kvstore: vLLM has no KV connector factory (%s); set kv_connector_module_path=%s", e, MODULE)
        return
    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and NAME in registry:
        return                                  # registered before: by this plugin, or by vLLM itself
    try:
        KVConnectorFactory.register_connector(NAME, MODULE, CLASS)
    except ValueError:                          # "already registered": the factory refuses a second registration
        pass

"""kvtier's vLLM integration: the KVTierConnector and its registration with vLLM.

``register`` is the ``vllm.general_plugins`` entry point: vLLM calls it in every process (API
server, engine core, workers), so ``--kv-transfer-config '{"kv_connector":"KVTierConnector",
"kv_role":"kv_both"}'`` works without a module path. Importing this package imports no vLLM.
"""
from __future__ import annotations

__all__ = ["register", "CONNECTOR_NAME", "CONNECTOR_MODULE"]

CONNECTOR_NAME = "KVTierConnector"
CONNECTOR_MODULE = "kvtier.plugins.vllm.connector"


def register() -> None:
    from kvtier.plugins.vllm.compat import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:  # register_connector raises on duplicates
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)

"""A KV connector that does nothing: the miss-path baseline.

vLLM configures itself differently once any `kv_transfer_config` is set (its CPU build
reserves another core per rank, the scheduler asks the connector about every request,
the model runner calls it every layer and step). This connector answers "nothing to
load" and saves nothing, so an engine running it against one running kvflow separates
vLLM's own cost of having a connector from kvflow's.

    KVTransferConfig(kv_connector="NoopConnector", kv_role="kv_both",
                     kv_connector_module_path="noop_connector")
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NoopConnector(KVConnectorBase_V1):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

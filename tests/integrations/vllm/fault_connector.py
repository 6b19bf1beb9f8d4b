"""A test KV connector that damages vLLM's KV cache from inside its worker (loaded by module path beside
kv-canary's connector under MultiConnector, so the multi-process test can inject a fault where the KV
tensors live): after its `at`-th forward it adds 1 to one V element of block 1 (the first block vLLM
hands out, its first request's prompt) in layer 0."""
from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class FaultMeta(KVConnectorMetadata):
    pass


class FaultConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.at = int(extra.get("at", 4))
        self.forwards = 0
        self.caches = None

    def register_kv_caches(self, kv_caches):
        self.caches = list(kv_caches.values())

    def start_load_kv(self, forward_context, **kwargs):
        return

    def wait_for_layer_load(self, layer_name):
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return

    def wait_for_save(self):
        if self.caches is None:
            return
        self.forwards += 1
        if self.forwards == self.at:
            cache = self.caches[0]
            nb, heads, bs, two_hd = cache.shape
            cache.view(nb, heads, 2 * bs, two_hd // 2)[1, 0, bs + 3, 1] += 1.0

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return

    def build_connector_meta(self, scheduler_output):
        return FaultMeta()

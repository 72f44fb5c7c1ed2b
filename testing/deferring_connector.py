"""A KV connector that only defers each request once: the floor of asynchronous lookups.

vLLM lets a connector answer ``get_num_new_matched_tokens`` with ``None`` while a
request's lookup is in flight; the scheduler then skips the request and asks again
in a later step. :class:`DeferringConnector` does exactly that and nothing else: a
request's first call returns ``None``, every later one ``(0, False)``; it loads,
saves and looks up nothing. A scheduler with it pays what vLLM itself spends on the
protocol (the step that skips each request, the local prefix lookup asked again),
with the connector's own Python next to nothing. ``benchmarks.scheduler_overhead``
runs it beside KVPoolConnector and no connector, so the admission a connector with
asynchronous lookups can reach on this vLLM is measured, not derived.

Benchmarks and tests only. It lives in ``testing``, not in ``benchmarks``,
because importing the ``benchmarks`` package sets the benchmarks' environment
(quiet vLLM logs, among others), which engines started later would inherit.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

#: ``KVTransferConfig`` fields that load this connector by module path.
TRANSFER: dict[str, Any] = {
    "kv_connector": "DeferringConnector",
    "kv_connector_module_path": "testing.deferring_connector",
    "kv_role": "kv_both",
}


class DeferringConnector(KVConnectorBase_V1, SupportsHMA):
    """Defers each request's first lookup one step; never finds, loads or saves anything."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        self._deferred: set[str] = set()

    @property
    def deferred(self) -> frozenset[str]:
        """The requests deferred once and not yet finished."""
        return frozenset(self._deferred)

    # --- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        if req_id in self._deferred:
            return 0, False
        self._deferred.add(req_id)
        return None, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._deferred.discard(request.request_id)
        return False, None

    # --- worker side (never built by the scheduler benchmarks) ----------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

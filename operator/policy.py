"""What the cluster's admin allows pools (an image allowlist, replica caps), and who the
operator's own pods are: the operator's settings that shape every pool it runs.

Set by ``kvpool-operator run`` flags (the chart's ``operator.*`` values); pure data.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorPolicy:
    """Limits on what a pool may ask for, and the operator's own pods (for the NetworkPolicy)."""

    # A pool's image must start with one of these (empty: any image).
    image_prefixes: tuple[str, ...] = ()
    max_master_replicas: int | None = None
    max_store_replicas: int | None = None
    # The operator's pods (namespace and labels): let in to the masters' health endpoint.
    operator_namespace: str | None = None
    operator_pod_labels: tuple[tuple[str, str], ...] = ()

    @property
    def operator_pods_known(self) -> bool:
        return bool(self.operator_namespace and self.operator_pod_labels)

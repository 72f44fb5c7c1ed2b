"""What the dashboards and alert rules assume about how series are scraped and labelled.

The chart's monitoring objects must produce exactly these labels:

* ``namespace`` — the Kubernetes namespace of the scraped pod (the Prometheus Operator adds it);
* ``pool`` — the ``MooncakeKVPool`` a pod belongs to, copied from the pod label
  ``kvpool.mooncake.io/pool`` (the operator sets it on master, store and consumer pods);
* ``job`` — :data:`MASTER_JOB` for Mooncake master targets, :data:`OPERATOR_JOB` for the operator;
* ``namespace`` and ``service`` on the operator's targets tell its installs apart
  (:data:`OPERATOR_RELEASE`): the Prometheus Operator adds ``service``, the chart's Service of a
  release, so several releases (each watching its own namespaces) are each seen down;
* vLLM targets get the scrape rule ``kvpool.connector.contract.metric_names.VLLM_NAME_RELABEL``, so the
  dashboards see vLLM's canonical ``vllm:`` names;
* the operator's own ``namespace``/``pool`` labels (on its per-pool gauges) must survive the scrape
  (``honorLabels: true`` on its monitor), or they would become ``exported_namespace``.

Every template variable selects everything with the regex ``.*`` (its "All" value), which also
matches series that lack the label, so the dashboards work before those labels are in place.
"""

from __future__ import annotations

from kvpool.connector.contract.metric_names import VLLM_LABELS
from kvpool.operator.names import LABEL_POOL

NAMESPACE = "namespace"
POOL = "pool"
POOL_POD_LABEL = LABEL_POOL  # relabelled into ``pool``
MODEL, ENGINE = VLLM_LABELS  # vLLM's own labels: model_name, engine

MASTER_JOB = "mooncake-master"
OPERATOR_JOB = "kvpool-operator"
OPERATOR_RELEASE = (NAMESPACE, "service")  # one operator install (its replicas share both)

ALL_VALUE = ".*"

# Dashboard template variables: name -> the label it filters.
VAR_DATASOURCE = "datasource"
VAR_NAMESPACE = "namespace"
VAR_POOL = "pool"
VAR_MODEL = "model"
VAR_ENGINE = "engine"
VARIABLE_LABELS = {VAR_NAMESPACE: NAMESPACE, VAR_POOL: POOL, VAR_MODEL: MODEL, VAR_ENGINE: ENGINE}

# Grafana's interval macro used by every rate in a panel.
RATE_INTERVAL = "$__rate_interval"

DASHBOARD_TAG = "mooncake-kvpool"


def selector(*variables: str, **fixed: str) -> str:
    """``{label=~"$var", ..., label="value"}`` for the given template variables and fixed labels."""
    parts = [f'{VARIABLE_LABELS[v]}=~"${v}"' for v in variables]
    parts += [f'{label}="{value}"' for label, value in fixed.items()]
    return "{" + ", ".join(parts) + "}"

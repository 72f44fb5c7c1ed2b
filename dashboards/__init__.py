"""Grafana dashboards and Prometheus alert rules for mooncake-kvpool, generated from code.

Metric names come from ``kvpool.connector.contract.metric_names`` and
``kvpool.operator.metric_names`` (ours) and :mod:`dashboards.external` (the Mooncake
master's and vLLM's own). The chart ships them, so they are written there
(``python scripts/generate.py``, or ``python -m dashboards`` for these alone):

* ``charts/mooncake-kvpool/files/dashboards/<uid>.json`` — the Connector, Pool and
  Operator dashboards;
* ``charts/mooncake-kvpool/files/alerts.yaml`` — the alert rules (a Prometheus rules file).

:mod:`dashboards.conventions` names the labels the scrape configuration must provide.
"""

"""Grafana dashboards and Prometheus alert rules for mooncake-kvpool, generated from code.

Metric names come from ``kvpool.connector.contract.metric_names`` and
``kvpool.operator.metric_names`` (ours) and :mod:`dashboards.external` (the Mooncake
master's and vLLM's own). ``python -m dashboards`` writes:

* ``dashboards/<uid>.json`` and ``charts/mooncake-kvpool/files/dashboards/<uid>.json`` —
  the Connector, Pool and Operator dashboards;
* ``dashboards/alerts.yaml`` and ``charts/mooncake-kvpool/files/alerts.yaml`` — the alert
  rules (a Prometheus rules file).

:mod:`dashboards.conventions` names the labels the scrape configuration must provide.
"""

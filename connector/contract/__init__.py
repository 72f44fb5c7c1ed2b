"""The contract the connector and the operator share.

Nothing here imports vLLM or torch (the operator's image has neither): the
KV-layout description and its rules (``layout``), the connector settings and
their renderings (``settings``), the pool's key scheme (``keys``), the
metric names the dashboards and alerts are generated from (``metric_names``)
and the Mooncake environment variables with the values the project sets
(``mooncake_env``).
"""

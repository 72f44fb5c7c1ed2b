"""Kubernetes operator for the ``MooncakeKVPool`` custom resource.

It runs a Mooncake master (single or HA with etcd) and store pods, validates each
consuming vLLM Deployment's KV layout with the connector's own contract
(``kvpool.connector.layout.check``) and rolls those Deployments out with matching
connector settings. Imports neither vLLM nor torch.
"""

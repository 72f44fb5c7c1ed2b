"""A pool and engines on one machine: the product commands and what they are made of.

``pool`` (a Mooncake master and store on loopback) and ``pool_command``
(``kvpool-local-pool``: that pool for vLLM servers, with the ``--kv-transfer-config``
to pass them); ``layout_probe`` and ``layout_command`` (``kvpool-layout``: the KV
layout vLLM builds for a model, computed with vLLM's own classes, no weights);
``demo`` (``kvpool-demo``) and what it runs: ``tiny_model`` (a tiny random-weight
hybrid Gemma3), ``engine`` (a greedy vLLM CPU engine on token-id prompts, in a fresh
process) and ``recording`` (the connector plus a record of what it observed). The
tests' harness builds on these in ``testing`` (not shipped). Nothing here is
imported by the connector itself.
"""

"""A pool and engines on one machine: the ``kvpool-demo`` command and what it is made of.

``pool`` (a Mooncake master and store on loopback), ``tiny_model`` (a tiny
random-weight hybrid Gemma3), ``engine`` (a greedy vLLM CPU engine on
token-id prompts, in this process or a fresh one), ``recording`` (the
connector plus a record of what it observed) and ``demo``. Nothing here is
imported by the connector itself.
"""

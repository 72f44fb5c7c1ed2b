"""What the tests and the benchmarks share: real vLLM pieces, engine runs, models, services.

``kv_cache`` (vLLM KV-cache configs and coordinators from compact group
descriptions), ``scheduler`` (vLLM's real ``Scheduler`` with a connector),
``engine`` (engine runs with everything the tests check, on top of
``kvpool.connector.local.engine``), ``models`` (random-weight models beyond the
demo's tiny Gemma3), ``prompts`` (the shared-prefix prompts and their pool
keys), ``services`` (Prometheus and an OTLP receiver on loopback).
"""

"""Test scaffolding shared by ``tests/`` and ``benchmarks/``; never shipped (not in the wheel, not
in an image).

``engine`` (engine runs with everything the tests check, on top of the demo's runner
``kvpool.connector.local.engine``, and public accessors to an engine's connector:
``scheduler_of``, ``worker_of``), ``models`` (the demo's tiny Gemma3 and random-weight
models beyond it), ``kv_cache`` (vLLM KV-cache configs and coordinators from compact group
descriptions), ``scheduler`` (vLLM's real ``Scheduler`` with a connector), ``worker`` (a
connector worker side on a pool), ``prompts`` (the shared-prefix prompts and their pool keys),
``objects`` (forged stored objects), ``mooncake_faults`` (faults injected at the Mooncake
client: stalled calls, failing reads), ``deferring_connector`` (a connector that only defers
each request one step), ``services`` (Prometheus and an OTLP receiver on loopback),
``kube_api`` and ``server_side`` (the emulated Kubernetes API), ``operator_objects`` (sample
pools and vLLM Deployments), ``node`` (the test node of the end-to-end suite).
"""

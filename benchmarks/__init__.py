"""Side-by-side benchmarks of the KVPool connector (issue 8).

``python -m benchmarks`` runs them all, each in its own process; each also runs
alone (``python -m benchmarks.lookup``). ``--smoke`` runs a tiny version in
seconds (what the test suite checks); ``--write`` stores the tables as JSON and
Markdown under ``benchmarks/results/`` and the plots under ``benchmarks/plots/``.

Importing the package sets (without overriding) the environment every
benchmark needs before vLLM or Mooncake load: CPU vLLM in this process, no hub
access, loopback addresses only, quiet logs.
"""

from __future__ import annotations

import os

BENCH_ENV: dict[str, str] = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # Loopback only: vLLM would otherwise find "its" address by routing to 8.8.8.8.
    "VLLM_HOST_IP": "127.0.0.1",
    "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1",
    "MC_STORE_CLIENT_SETUP_RETRIES": "3",
    # Tables, not logs: Mooncake (glog) errors only, vLLM errors only.
    "MC_LOG_LEVEL": "ERROR",
    "VLLM_LOGGING_LEVEL": "ERROR",
}

for _key, _value in BENCH_ENV.items():
    os.environ.setdefault(_key, _value)

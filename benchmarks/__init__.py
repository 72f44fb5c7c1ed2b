"""Side-by-side benchmarks of the KVPool connector.

``python -m benchmarks`` runs them all, each in its own process; each also runs
alone (``python -m benchmarks.lookup``). ``--smoke`` runs a tiny version in
seconds (what the test suite checks); ``--write`` stores the tables as JSON and
Markdown under ``benchmarks/results/`` and the plots under ``benchmarks/plots/``.

Importing the package prepares the environment every benchmark needs before
vLLM or Mooncake load: the engine environment of ``kvpool.connector.local.engine``
(CPU vLLM in this process, no hub access, loopback addresses), Mooncake clients
on loopback (vLLM's in-tree connector sets its clients up itself), quiet logs,
and what vLLM leaves in the temporary folder in a folder of the run's own,
removed when the run exits (``testing.private_temp``).
"""

from __future__ import annotations

import os

from kvpool.connector.contract import mooncake_env
from kvpool.connector.local.pool import LOOPBACK
from testing.engine import apply_engine_env
from testing.private_temp import use_private_temp_folder

#: Set (without overriding) on top of the engine environment: tables, not logs.
BENCH_ENV: dict[str, str] = {
    mooncake_env.REQUESTER_LOCAL_HOSTNAME: LOOPBACK,
    mooncake_env.LOG_LEVEL: mooncake_env.ERRORS_ONLY,
    "VLLM_LOGGING_LEVEL": "ERROR",
}

apply_engine_env()
use_private_temp_folder()
mooncake_env.configure_client_process(LOOPBACK)
for _key, _value in BENCH_ENV.items():
    os.environ.setdefault(_key, _value)

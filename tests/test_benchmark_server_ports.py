"""A benchmark's vLLM server listens only once its model loads, tens of seconds after its port
is drawn: the port is held meanwhile (no other test process's server takes it), until it stops.

Checked in a child interpreter: importing the ``benchmarks`` package quiets vLLM's and
Mooncake's logs for every engine this process would start later (tests read those logs).
"""

from __future__ import annotations

from pathlib import Path

from testing.child_processes import python_answer

CHECK = """
import json, sys
from pathlib import Path
from benchmarks.serving import ApiServer
from kvpool.connector.local.ports import bindable, listenable

# A server still loading its model: it has not bound its port yet.
ApiServer.command = lambda self: [sys.executable, "-c", "import time; time.sleep(60)"]
tmp = Path(sys.argv[1])
server = ApiServer(tmp / "model", core=0, prefix_caching=False, log_path=tmp / "server.log")
try:
    server.start()
    held = bool(server.port) and not bindable(server.port)
finally:
    server.stop()
print(json.dumps({"held while loading": held, "free once stopped": listenable(server.port)}))
"""


def test_a_drawn_server_port_is_held_until_the_server_stops(tmp_path: Path) -> None:
    assert python_answer(CHECK, str(tmp_path)) == {"held while loading": True, "free once stopped": True}

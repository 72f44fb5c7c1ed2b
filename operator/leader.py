"""Whether an HA pool's leader serves: asked of the masters' own ``GET /health``.

Every master answers ``/health`` on its metrics port, a standby too:
``{"role": "leader"|"standby", "ha_state": ..., "service_ready": bool,
"leader_address": "host:rpcPort"|null}``. The leader publishes its address in etcd
before it serves (``ha_state`` ``leader_warmup``), so a standby's word that a leader
exists is not enough: the check asks any master (through the master Service), then the
leader it names, and a leader serves only when that leader says ``service_ready``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp

from kvpool.operator import names
from kvpool.operator.components import MASTER_HEALTH_PATH

# Where the operator asks a master first: the master Service's metrics port.
SERVICE_HEALTH_URL = "http://{service}.{namespace}.svc:{port}" + MASTER_HEALTH_PATH


@dataclass(frozen=True)
class LeaderView:
    """Whether a leader serves, and what the masters said."""

    serves: bool
    message: str


def health_url(template: str, pool: str, namespace: str, port: int) -> str:
    """The first master to ask: ``template`` filled in for the pool's master Service."""
    return template.format(service=names.master_name(pool), namespace=namespace, port=port)


async def _health(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url) as response:
        if response.status != 200:
            raise aiohttp.ClientResponseError(
                response.request_info, (), status=response.status, message=f"HTTP {response.status}"
            )
        body = await response.json(content_type=None)
    if not isinstance(body, dict):
        raise ValueError(f"{url} answered {body!r}, not a JSON object")
    return body


def _serving(health: dict[str, Any]) -> bool:
    return health.get("role") == "leader" and health.get("service_ready") is True


async def check_leader(url: str, metrics_port: int, timeout: float = 3.0) -> LeaderView:
    """Ask the master at ``url``, then the leader it names; never raises."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            first = await _health(session, url)
            if _serving(first):
                return LeaderView(True, f"the leader at {first.get('leader_address')} serves")
            leader = first.get("leader_address")
            if not leader:
                return LeaderView(False, f"no master leads (asked {url}: role {first.get('role')!r})")
            host = str(leader).rsplit(":", 1)[0]
            answer = await _health(session, f"http://{host}:{metrics_port}{MASTER_HEALTH_PATH}")
            if _serving(answer):
                return LeaderView(True, f"the leader at {leader} serves")
            state = answer.get("ha_state") or answer.get("role")
            return LeaderView(False, f"the leader at {leader} does not serve yet ({state})")
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        return LeaderView(False, f"cannot ask the masters' health ({url}): {exc or type(exc).__name__}")

"""A three-member etcd on loopback: it serves with a member down, and the member rejoins."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from testing.etcd_cluster import EtcdCluster


def put_and_get(endpoint: str, key: str, value: str) -> str:
    """Through etcd's v3 JSON gateway (base64 keys and values)."""
    import base64

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    def post(path: str, body: dict[str, str]) -> dict:
        request = urllib.request.Request(
            f"http://{endpoint}/v3/kv/{path}", json.dumps(body).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.loads(reply.read())

    deadline = time.monotonic() + 30
    while True:  # a member lost may have led: the others elect a leader first (about a second)
        try:
            post("put", {"key": b64(key), "value": b64(value)})
            kvs = post("range", {"key": b64(key)})["kvs"]
            return base64.b64decode(kvs[0]["value"]).decode()
        except urllib.error.HTTPError as error:
            if error.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_a_member_killed_and_restarted_rejoins_and_the_cluster_serves_throughout() -> None:
    cluster = EtcdCluster().start()
    try:
        assert cluster.endpoints().count(",") == 2
        assert put_and_get(cluster.members[0].endpoint, "a", "1") == "1"
        cluster.kill(0)
        assert not cluster.members[0].running()
        assert put_and_get(cluster.members[1].endpoint, "b", "2") == "2"  # two of three: a quorum
        cluster.restart(0)
        assert put_and_get(cluster.members[0].endpoint, "b", "3") == "3"
        processes = [m.process for m in cluster.members]
    finally:
        cluster.stop()
    assert all(p is not None and p.poll() is not None for p in processes)
    assert not cluster.workdir.exists()

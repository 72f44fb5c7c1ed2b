"""With leader election on, several operator replicas may run and one acts; the Lease is
reachable through a Role in the release namespace only. Off (the default): one replica."""

from __future__ import annotations

from typing import Any

from kvpool.operator.rbac import LEASE_RULES
from tests.chart.helm import NAMESPACE, Helm, of_kind, one
from tests.chart.test_chart_operator import operator_container, operator_options


def lease_roles(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in of_kind(objects, "Role") if r["metadata"]["name"].endswith("-leader-election")]


def test_leader_election_is_on_and_the_lease_role_is_the_operators_rule(helm: Helm) -> None:
    objects = helm.template(sets=["operator.leaderElection.enabled=true", "operator.replicas=2"])
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    _, container = operator_container(objects)
    election = operator_options(container).leader_election
    assert election is not None and election.namespace == NAMESPACE
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    (role,) = lease_roles(objects)
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [rule.as_dict() for rule in LEASE_RULES]
    (binding,) = [
        b for b in of_kind(objects, "RoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"]
    ]
    assert binding["metadata"]["namespace"] == NAMESPACE


def test_without_leader_election_one_replica_at_a_time(helm: Helm) -> None:
    objects = helm.template(sets=["operator.replicas=3"])
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    _, container = operator_container(objects)
    assert operator_options(container).leader_election is None
    assert lease_roles(objects) == []

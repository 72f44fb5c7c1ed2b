"""With leader election on, several operator replicas may run and one acts; the Lease is
reachable through a Role in the release namespace only. Off (the default): one replica."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.operator.names import LEASES
from kvpool.operator.rbac import Permission, Rule, allowed, lease_rules
from tests.chart.helm import NAMESPACE, Helm, of_kind, one
from tests.chart.test_chart_operator import operator_container, operator_options


def lease_roles(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in of_kind(objects, "Role") if r["metadata"]["name"].endswith("-leader-election")]


def as_rules(role: dict[str, Any]) -> tuple[Rule, ...]:
    return tuple(
        Rule(group, tuple(r["resources"]), tuple(r["verbs"]), tuple(r.get("resourceNames", ())))
        for r in role["rules"]
        for group in r["apiGroups"]
    )


@pytest.mark.parametrize(
    "sets",
    [["operator.leaderElection.enabled=true", "operator.replicas=2"], ["webhook.enabled=true"]],
    ids=["leader-election", "webhook"],
)
def test_the_lease_role_reaches_the_lease_the_operator_is_told_to_elect_on(
    helm: Helm, sets: list[str]
) -> None:
    """Its Role names the Lease the operator's arguments name: a Role naming another one
    lets the first create through and then refuses every read, so no replica ever leads."""
    objects = helm.template(sets=sets)
    _, container = operator_container(objects)
    election = operator_options(container).leader_election
    assert election is not None
    (role,) = lease_roles(objects)
    rules = as_rules(role)
    for verb in ("get", "patch"):
        assert allowed(Permission(LEASES.group, LEASES.plural, verb, election.name), rules), verb
        assert not allowed(Permission(LEASES.group, LEASES.plural, verb, "other-lease"), rules), verb
    assert allowed(Permission(LEASES.group, LEASES.plural, "create"), rules)


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
    assert role["rules"] == [rule.as_dict() for rule in lease_rules(election.name)]
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

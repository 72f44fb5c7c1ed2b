"""Grants: one Mooncake tenant each (or one per shared reuse domain), the master's policy
rendered from them, cut as Mooncake cuts, refused by field and rule (pure)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from kvpool.connector.contract.tenant_policy import POLICY_FILE, effective_quotas, policy_yaml
from kvpool.connector.local import tenant_quotas
from kvpool.operator import names
from kvpool.operator.consumers import Refusal, refusal
from kvpool.operator.grants import Grant, grant_consumer_statuses, grant_status, read_grant
from kvpool.operator.merge_patch import apply_merge_patch
from kvpool.operator.names import CONFIGMAPS
from kvpool.operator.plan import build_plan
from kvpool.operator.pod_injection import PodInjection, admit_pod
from testing.kube_api import NAMESPACE
from testing.operator_objects import consumer, pool_spec, vllm_deployment
from testing.pod_admission import replica_set_pod, serving_pool

MiB = 1 << 20


def grant(name: str, ceiling: str, pool: str = "pool", **spec: Any) -> Grant:
    return read_grant(
        {
            "metadata": {"name": name, "namespace": NAMESPACE, "generation": 1},
            "spec": {"pool": pool, "ceiling": ceiling, **spec},
        }
    )


def tenant_spec(*grants: str | None, **store: Any) -> dict[str, Any]:
    consumers = [
        {**consumer(), "name": f"llm-{i}", **({"grant": g} if g else {})} for i, g in enumerate(grants)
    ]
    return pool_spec(
        tenancy={"enabled": True},
        store={"segmentSize": "16MB", "replicas": 2, **store},
        consumers=consumers,
    )


def test_the_cut_is_mooncakes_proportional_share() -> None:
    assert effective_quotas({"a": 24 * MiB, "b": 24 * MiB}, 32 * MiB) == {"a": 16 * MiB, "b": 16 * MiB}
    assert effective_quotas({"a": 8, "b": 8}, 32) == {"a": 8, "b": 8}
    cut = effective_quotas({"a": 1, "b": 1, "c": 1}, 2)
    assert sum(cut.values()) == 2 and sorted(cut.values()) == [0, 1, 1]
    # One policy format for the local pool and the operator.
    assert tenant_quotas.policy_yaml is policy_yaml
    assert policy_yaml({}) == "version: 1\ntenants: []\n"


def test_a_pool_with_tenancy_renders_the_policy_and_each_consumers_tenant() -> None:
    grants = [
        grant("team-a", "24MB"),
        grant("team-b", "24MB"),
        grant("other", "8MB", pool="elsewhere"),
    ]
    plan = build_plan("pool", NAMESPACE, tenant_spec("team-a", "team-b"), grants=grants)
    assert plan.problems == []
    objs = {f"{c['kind']}/{c['metadata']['name']}": c for c in plan.children}
    policy = objs["ConfigMap/pool-tenants"]["data"][POLICY_FILE]
    assert policy == policy_yaml({f"{NAMESPACE}.team-a": 24 * MiB, f"{NAMESPACE}.team-b": 24 * MiB})
    master = objs["Deployment/pool-master"]["spec"]["template"]["spec"]
    (container,) = master["containers"]
    path = f"{names.TENANTS_MOUNT_PATH}/{POLICY_FILE}"
    assert set(tenant_quotas.master_args(path)) <= set(container["args"])
    assert {"name": "tenants", "mountPath": names.TENANTS_MOUNT_PATH, "readOnly": True} in container[
        "volumeMounts"
    ]
    assert {"name": "tenants", "configMap": {"name": "pool-tenants"}} in master["volumes"]
    tenants = [
        json.loads(inj.kv_transfer_config)["kv_connector_extra_config"]["tenant"] for inj in plan.consumers
    ]
    assert tenants == [f"{NAMESPACE}.team-a", f"{NAMESPACE}.team-b"]
    assert plan.tenancy is not None and plan.tenancy.capacity == 32 * MiB


def test_grants_of_one_reuse_domain_are_one_tenant_and_the_cut_is_in_their_status() -> None:
    grants = [
        grant("team-a", "24MB"),
        grant("shared-1", "8MB", reuseDomain="llama"),
        grant("shared-2", "16MB", reuseDomain="llama"),
    ]
    plan = build_plan("pool", NAMESPACE, tenant_spec("shared-1", "shared-2", "team-a"), grants=grants)
    assert plan.tenancy is not None
    assert plan.tenancy.requested == {"domain.llama": 16 * MiB, f"{NAMESPACE}.team-a": 24 * MiB}
    # 16 + 24 MiB asked of 32 MiB: cut to 12.8 and 19.2 MiB (Mooncake's largest remainder).
    assert plan.tenancy.effective == {"domain.llama": 13421773, f"{NAMESPACE}.team-a": 20132659}
    status = grant_status(grants[0], plan.tenancy)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Accepted"]["status"] == "True"
    assert conditions["Cut"]["status"] == "True" and "24Mi cut to" in conditions["Cut"]["message"]
    assert status["ceilingBytes"] == 20132659 and status["tenant"] == f"{NAMESPACE}.team-a"
    fits = build_plan("pool", NAMESPACE, tenant_spec("team-a", replicas=4), grants=grants[:1])
    assert fits.tenancy is not None
    fitting = {c["type"]: c["status"] for c in grant_status(grants[0], fits.tenancy)["conditions"]}
    assert fitting == {"Accepted": "True", "Cut": "False"}


@pytest.mark.parametrize(
    ("consumer_grant", "tenancy", "grants", "field", "rule"),
    [
        (None, True, [], "spec.consumers[0].grant", "consumer-grant"),
        ("missing", True, [], "spec.consumers[0].grant", "grant-not-found"),
        (
            "team-a",
            True,
            [grant("team-a", "8MB", pool="other")],
            "spec.consumers[0].grant",
            "grant-other-pool",
        ),
        ("team-a", True, [grant("team-a", "1KB")], "spec.consumers[0].grant", "grant-invalid"),
        ("team-a", False, [grant("team-a", "8MB")], "spec.consumers[0].grant", "tenancy-off"),
    ],
)
def test_a_consumer_attaches_only_to_a_grant_of_its_namespace_and_pool(
    consumer_grant: str | None, tenancy: bool, grants: list[Grant], field: str, rule: str
) -> None:
    raw = tenant_spec(consumer_grant)
    raw["tenancy"] = {"enabled": tenancy}
    plan = build_plan("pool", NAMESPACE, raw, grants=grants)
    assert [(p.field, p.rule) for p in plan.problems] == [(field, rule)]
    assert plan.children == [] and plan.consumers == []


def test_an_external_pool_takes_no_tenancy_and_a_pool_without_it_has_no_policy() -> None:
    raw = pool_spec(external={"masterServerAddress": "mooncake.example:50051"}, tenancy={"enabled": True})
    raw.pop("image")
    raw["store"] = {"segmentSize": "1GB"}
    raw["consumers"] = [{**consumer(), "grant": "team-a"}]
    plan = build_plan("pool", NAMESPACE, raw, grants=[grant("team-a", "8MB")])
    assert ("spec.tenancy.enabled", "external-tenancy") in [(p.field, p.rule) for p in plan.problems]
    plain = build_plan("pool", NAMESPACE, pool_spec())
    assert (CONFIGMAPS, "pool-tenants") in plain.absent and plain.tenancy is None
    assert "tenant" not in json.loads(plain.consumers[0].kv_transfer_config)["kv_connector_extra_config"]


def test_a_consumer_pod_admitted_by_the_webhook_gets_its_grants_tenant() -> None:
    deployment = vllm_deployment("llm-0", allow_pool=None)
    deployment["spec"]["template"]["metadata"]["labels"][names.LABEL_ALLOW_POOL] = "pool"
    pod = replica_set_pod(deployment)
    spec = tenant_spec("team-a")
    grants = [grant("team-a", "8MB")]
    answer = admit_pod(pod, NAMESPACE, serving_pool(spec), grants=grants)
    assert isinstance(answer, PodInjection), answer
    container = apply_merge_patch(pod, answer.patch)["spec"]["containers"][0]
    (flag,) = [a for a in container["args"] if a.startswith("--kv-transfer-config=")]
    config = json.loads(flag.split("=", 1)[1])
    assert config["kv_connector_extra_config"]["tenant"] == f"{NAMESPACE}.team-a"
    # Without its grant the Pod is refused, naming the field and the rule.
    refusal = admit_pod(pod, NAMESPACE, serving_pool(spec))
    assert isinstance(refusal, Refusal) and "grant-not-found" in str(refusal)


def master_template_annotations(plan: Any) -> dict[str, str]:
    (master,) = [
        c for c in plan.children if c["kind"] == "Deployment" and c["metadata"]["name"] == "pool-master"
    ]
    return master["spec"]["template"]["metadata"].get("annotations") or {}


def test_a_grant_change_rolls_the_master_unless_the_pool_waits_for_its_next_start() -> None:
    def stamp(grants: list[Grant], changes: str | None = None) -> str | None:
        raw = tenant_spec("team-a")
        if changes is not None:
            raw["tenancy"]["grantChanges"] = changes
        plan = build_plan("pool", NAMESPACE, raw, grants=grants)
        assert plan.problems == []
        return master_template_annotations(plan).get(names.ANNOTATION_TENANT_POLICY)

    before = stamp([grant("team-a", "8MB")])
    assert before is not None
    assert stamp([grant("team-a", "8MB")]) == before  # the same grants: nothing rolls
    assert stamp([grant("team-a", "12MB")]) not in (None, before)  # a ceiling changed
    assert stamp([grant("team-a", "8MB"), grant("team-b", "8MB")]) not in (None, before)  # a grant added
    # NextMasterStart: the template does not depend on the grants; the policy file still follows.
    assert stamp([grant("team-a", "8MB")], "NextMasterStart") is None
    assert stamp([grant("team-a", "12MB")], "NextMasterStart") is None
    # Without tenancy there is no policy to stamp.
    plan = build_plan("pool", NAMESPACE, pool_spec(), grants=[])
    assert names.ANNOTATION_TENANT_POLICY not in master_template_annotations(plan)


def test_an_unknown_grant_change_mode_is_refused_by_field() -> None:
    raw = tenant_spec("team-a")
    raw["tenancy"]["grantChanges"] = "Sometimes"
    plan = build_plan("pool", NAMESPACE, raw, grants=[grant("team-a", "8MB")])
    assert [p.field for p in plan.problems] == ["spec.tenancy.grantChanges"]
    assert plan.children == []


OTHER = "team-b"


def grant_in(namespace: str, name: str, ceiling: str, **spec: Any) -> Grant:
    return read_grant(
        {
            "metadata": {"name": name, "namespace": namespace, "generation": 1},
            "spec": {"pool": "pool", "ceiling": ceiling, "poolNamespace": NAMESPACE, **spec},
        }
    )


def test_grants_from_listed_namespaces_are_tenants_and_others_are_not() -> None:
    grants = [
        grant("own", "16MB"),
        grant_in(OTHER, "llm", "16MB"),
        grant_in("team-c", "llm", "16MB"),  # not listed
        grant_in(OTHER, "elsewhere", "16MB", poolNamespace="team-x"),  # another pool's
    ]
    raw = tenant_spec("own")
    raw["tenancy"]["grantNamespaces"] = [OTHER]
    plan = build_plan("pool", NAMESPACE, raw, grants=grants)
    assert plan.valid, plan.problems
    assert plan.tenancy is not None
    assert plan.tenancy.tenants == {"own": f"{NAMESPACE}.own", f"{OTHER}/llm": f"{OTHER}.llm"}
    # 16 + 16 MiB of 32: both fit; the other namespace's grant is told where the master is.
    status = grant_status(grants[1], plan.tenancy, master_address=plan.master_address)
    assert status["tenant"] == f"{OTHER}.llm" and status["ceilingBytes"] == 16 * MiB
    assert status["masterServerAddress"] == f"pool-master.{NAMESPACE}.svc:50051"
    refused = grant_status(grants[2], plan.tenancy, "not listed", reason="NamespaceNotAllowed")
    assert [(c["type"], c["status"], c["reason"]) for c in refused["conditions"]] == [
        ("Accepted", "False", "NamespaceNotAllowed")
    ]
    policy = next(
        c for c in plan.children if c["kind"] == "ConfigMap" and c["metadata"]["name"] == "pool-tenants"
    )
    assert policy["data"][POLICY_FILE] == policy_yaml(
        {f"{NAMESPACE}.own": 16 * MiB, f"{OTHER}.llm": 16 * MiB}
    )


def test_a_reuse_domain_never_spans_two_namespaces() -> None:
    """A tenant naming another namespace's domain gets a tenant of its own: it cannot read
    that namespace's blocks by choosing a name."""
    grants = [
        grant("own", "8MB", reuseDomain="llama"),
        grant_in(OTHER, "a", "8MB", reuseDomain="llama"),
        grant_in(OTHER, "b", "16MB", reuseDomain="llama"),
    ]
    raw = tenant_spec("own")
    raw["tenancy"]["grantNamespaces"] = [OTHER]
    plan = build_plan("pool", NAMESPACE, raw, grants=grants)
    assert plan.tenancy is not None
    assert plan.tenancy.tenants == {
        "own": "domain.llama",
        f"{OTHER}/a": f"{OTHER}.domain-llama",
        f"{OTHER}/b": f"{OTHER}.domain-llama",
    }
    assert plan.tenancy.requested == {"domain.llama": 8 * MiB, f"{OTHER}.domain-llama": 16 * MiB}


def test_a_namespace_named_domain_cannot_take_the_pools_reuse_domain() -> None:
    """A grant ``llama`` of a listed namespace ``domain`` would be tenant ``domain.llama``, the
    pool's own reuse domain ``llama``: its consumers would read and write that domain's blocks.
    It is left out, and says why; the pool's grant keeps the tenant."""
    grants = [grant("own", "8MB", reuseDomain="llama"), grant_in("domain", "llama", "16MB")]
    raw = tenant_spec("own")
    raw["tenancy"]["grantNamespaces"] = ["domain"]
    plan = build_plan("pool", NAMESPACE, raw, grants=grants)
    assert plan.valid, plan.problems
    assert plan.tenancy is not None
    assert plan.tenancy.tenants == {"own": "domain.llama"}
    assert plan.tenancy.requested == {"domain.llama": 8 * MiB}
    assert not plan.grant_children and all(c.namespace != "domain" for c in plan.consumers)
    status = grant_status(grants[1], plan.tenancy, "unused", reason="PoolRefuses")
    [accepted] = status["conditions"]
    assert (accepted["type"], accepted["status"], accepted["reason"]) == ("Accepted", "False", "TenantTaken")
    assert "domain.llama" in accepted["message"] and NAMESPACE in accepted["message"]
    assert "tenant" not in status


LONG_NAMESPACES = ["ml-serving-production-inference-team-alpha", "a" * 20 + "-" + "b" * 42]


@pytest.mark.parametrize("namespace", LONG_NAMESPACES)
def test_a_digest_tenant_never_is_another_namespaces_grant(namespace: str) -> None:
    """A tenant too long for Mooncake becomes a digest. The digest of a grant of a long
    namespace never follows a cut namespace and a dot: the namespace so named (listed too)
    would get that tenant, and the victim's blocks, with a grant named after the digest."""
    victim = grant_in(namespace, "llama-70b-chat-shared-cache", "8MB")
    cut = namespace[:40].rstrip("-.")
    digest = hashlib.sha256(f"{namespace}.llama-70b-chat-shared-cache".encode()).hexdigest()[:16]
    impostor = grant_in(cut, digest, "8MB")
    raw = tenant_spec("own")
    raw["tenancy"]["grantNamespaces"] = [namespace, cut]
    plan = build_plan("pool", NAMESPACE, raw, grants=[grant("own", "8MB"), victim, impostor])
    assert plan.tenancy is not None
    tenants = plan.tenancy.tenants
    victims = tenants[f"{namespace}/{victim.name}"]
    assert len(victims) <= 63 and victims != tenants[f"{cut}/{impostor.name}"]
    # Whatever the grant's name: a tenant `<ns>.<rest>` is grant `<rest>` of namespace `<ns>`.
    head, dot, _ = victims.partition(".")
    assert not dot or head == namespace


def test_a_consumer_cannot_attach_to_a_grant_of_another_namespace() -> None:
    raw = tenant_spec("llm")
    raw["tenancy"]["grantNamespaces"] = [OTHER]
    plan = build_plan("pool", NAMESPACE, raw, grants=[grant_in(OTHER, "llm", "8MB")])
    assert [(p.field, p.rule) for p in plan.problems] == [("spec.consumers[0].grant", "grant-not-found")]


@pytest.mark.parametrize(
    ("tenancy", "store", "policy", "rule"),
    [
        ({"enabled": True, "grantNamespaces": [NAMESPACE]}, {}, {}, "own-namespace"),
        ({"enabled": True, "grantNamespaces": [OTHER, OTHER]}, {}, {}, "duplicate"),
        (
            {"enabled": True, "grantNamespaces": [OTHER]},
            {},
            {"watched_namespaces": (NAMESPACE,)},
            "namespace-not-watched",
        ),
        (
            {"enabled": True, "grantNamespaces": [OTHER]},
            {},
            {"network_policy_end_port": False},
            "end-port-needed",
        ),
        ({"enabled": True, "grantNamespaces": [OTHER]}, {"mode": "embedded"}, {}, "embedded-stores"),
        ({"enabled": False, "grantNamespaces": [OTHER]}, {}, {}, "tenancy-off"),
        ({"enabled": True, "grantNamespaces": ["Not_A_Namespace"]}, {}, {}, "schema:string_pattern_mismatch"),
    ],
)
def test_bad_grant_namespaces_are_refused_by_field_and_rule(
    tenancy: dict[str, Any], store: dict[str, Any], policy: dict[str, Any], rule: str
) -> None:
    from kvpool.operator.policy import OperatorPolicy

    raw = tenant_spec("own", **store)
    raw["tenancy"] = tenancy
    if not tenancy["enabled"]:
        raw["consumers"][0].pop("grant")
    plan = build_plan("pool", NAMESPACE, raw, OperatorPolicy(**policy), grants=[grant("own", "8MB")])
    assert [p.rule for p in plan.problems] == [rule], plan.problems
    assert all(p.field.startswith("spec.tenancy.grantNamespaces") for p in plan.problems)
    assert plan.children == []


def tenant_deployment(labels: dict[str, str], namespace: str = OTHER) -> dict[str, Any]:
    deployment = vllm_deployment(allow_pool=None)
    deployment["metadata"]["namespace"] = namespace
    deployment["metadata"]["labels"].update(labels)
    return deployment


ALLOW = {names.LABEL_ALLOW_POOL: "pool", names.LABEL_ALLOW_POOL_NAMESPACE: NAMESPACE}


@pytest.mark.parametrize(
    ("labels", "pool_namespace", "rule"),
    [
        (ALLOW, NAMESPACE, None),
        ({names.LABEL_ALLOW_POOL: "pool"}, NAMESPACE, "consent"),  # which pool "pool"? its own namespace's
        (ALLOW, OTHER, "consent"),  # a pool of the same name in the Deployment's namespace
        ({**ALLOW, names.LABEL_ALLOW_POOL_NAMESPACE: "team-x"}, NAMESPACE, "consent"),
        ({**ALLOW, names.LABEL_CONSUMER_OF: "pool"}, NAMESPACE, "other-pool"),  # patched by its own "pool"
        ({**ALLOW, names.LABEL_CONSUMER_OF: "pool", names.LABEL_POOL_NAMESPACE: NAMESPACE}, NAMESPACE, None),
    ],
)
def test_a_pool_in_another_namespace_patches_only_with_consent_naming_its_namespace(
    labels: dict[str, str], pool_namespace: str, rule: str | None
) -> None:
    found = refusal(tenant_deployment(labels), "pool", pool_namespace=pool_namespace)
    assert (found.rule if found else None) == rule, found
    if found is not None and rule == "consent" and pool_namespace != OTHER:
        assert names.LABEL_ALLOW_POOL_NAMESPACE in found.message


def granted_spec() -> dict[str, Any]:
    raw = tenant_spec("own")
    raw["tenancy"]["grantNamespaces"] = [OTHER]
    return raw


def grant_with_consumers(*consumers: dict[str, Any], namespace: str = OTHER, **spec: Any) -> Grant:
    return read_grant(
        {
            "metadata": {"name": "llm", "namespace": namespace, "generation": 1, "uid": "uid-of-llm"},
            "spec": {
                "pool": "pool",
                "poolNamespace": NAMESPACE,
                "ceiling": "8MB",
                "consumers": list(consumers),
                **spec,
            },
        }
    )


def test_a_grants_consumers_in_its_namespace_get_its_tenant_and_a_configmap_it_owns() -> None:
    grants = [grant("own", "8MB"), grant_with_consumers(consumer("chat"), consumer("batch"))]
    plan = build_plan("pool", NAMESPACE, granted_spec(), grants=grants)
    assert plan.valid, plan.problems
    own, chat, batch = plan.consumers
    assert (own.namespace, own.pool_namespace) == ("", "")
    assert [(c.namespace, c.deployment, c.pool_namespace) for c in (chat, batch)] == [
        (OTHER, "chat", NAMESPACE),
        (OTHER, "batch", NAMESPACE),
    ]
    assert chat.display_name == f"{OTHER}/chat" and chat.config_map == "pool-llm-connector"
    assert json.loads(chat.kv_transfer_config)["kv_connector_extra_config"]["tenant"] == f"{OTHER}.llm"
    (child,) = plan.grant_children
    assert (
        child.obj["metadata"]["namespace"] == OTHER and child.obj["metadata"]["name"] == "pool-llm-connector"
    )
    (owner,) = child.owned()["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["blockOwnerDeletion"]) == (
        "MooncakeKVPoolGrant",
        "llm",
        "uid-of-llm",
        False,
    )
    # The master's address crosses namespaces: its Service's full name.
    assert f"pool-master.{NAMESPACE}.svc:50051" in chat.kv_transfer_config
    # The injected Deployment carries the pool's namespace, on its Pods too (the pool's
    # NetworkPolicy admits exactly those).
    from kvpool.operator.consumers import injected

    patched = injected(tenant_deployment(ALLOW), chat)
    for labels in (patched["metadata"]["labels"], patched["spec"]["template"]["metadata"]["labels"]):
        assert labels[names.LABEL_POOL_NAMESPACE] == NAMESPACE
    assert patched["spec"]["template"]["metadata"]["labels"][names.LABEL_POOL] == "pool"


def test_a_deployment_two_grants_list_is_the_firsts_and_the_second_grant_says_so() -> None:
    first = grant_with_consumers(consumer("chat"), consumer("batch"))
    second = read_grant(
        {
            "metadata": {"name": "more", "namespace": OTHER, "generation": 1, "uid": "uid-of-more"},
            "spec": {
                "pool": "pool",
                "poolNamespace": NAMESPACE,
                "ceiling": "8MB",
                "consumers": [consumer("chat")],
            },
        }
    )
    plan = build_plan("pool", NAMESPACE, granted_spec(), grants=[grant("own", "8MB"), second, first])
    assert plan.valid, plan.problems
    chat = [c for c in plan.consumers if c.deployment == "chat"]
    assert (
        len(chat) == 1
        and json.loads(chat[0].kv_transfer_config)["kv_connector_extra_config"]["tenant"] == f"{OTHER}.llm"
    )
    listed = {c.grant.name: c.listed_elsewhere for c in plan.grant_children}
    assert listed == {"llm": {}, "more": {"chat": "llm"}}
    # Each grant's status: its consumers as the pool's status has them; the doubled one refused.
    pool_consumers = [
        {"name": f"{OTHER}/chat", "rolledOut": True, "message": "rolled out"},
        {"name": f"{OTHER}/batch", "rolledOut": False, "message": "refused: no consent"},
        {"name": "chat", "rolledOut": False, "message": "the pool's own chat, not the grant's"},
    ]
    assert grant_consumer_statuses(first, pool_consumers, listed["llm"]) == [
        {"name": "chat", "rolledOut": True, "message": "rolled out"},
        {"name": "batch", "rolledOut": False, "message": "refused: no consent"},
    ]
    (doubled,) = grant_consumer_statuses(second, pool_consumers, listed["more"])
    assert doubled["name"] == "chat" and not doubled["rolledOut"]
    assert "grant llm lists this Deployment too" in doubled["message"]
    assert grant_consumer_statuses(first, [], {})[0] == {
        "name": "chat",
        "rolledOut": False,
        "message": "not rolled yet",
    }
    status = grant_status(first, plan.tenancy, consumers=grant_consumer_statuses(first, pool_consumers, {}))
    assert [c["name"] for c in status["consumers"]] == ["chat", "batch"]


def test_an_unlisted_namespaces_grant_gets_no_consumers() -> None:
    raw = granted_spec()
    raw["tenancy"]["grantNamespaces"] = []
    plan = build_plan(
        "pool", NAMESPACE, raw, grants=[grant("own", "8MB"), grant_with_consumers(consumer("chat"))]
    )
    assert plan.valid and [c.deployment for c in plan.consumers] == ["llm-0"] and plan.grant_children == []


def tenant_pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    """A Pod of Deployment ``name`` in the grant's namespace, ``labels`` on its pod template."""
    deployment = vllm_deployment(name, allow_pool=None)
    deployment["metadata"]["namespace"] = OTHER
    deployment["spec"]["template"]["metadata"]["labels"].update(labels)
    return replica_set_pod(deployment)


def test_a_grants_consumer_pod_is_admitted_only_as_the_grant_lists_it_to_a_pool_that_takes_it() -> None:
    grants = [grant("own", "8MB"), grant_with_consumers(consumer("chat"))]
    pool = serving_pool(granted_spec())
    answer = admit_pod(tenant_pod("chat", ALLOW), OTHER, pool, grants=grants, pool_namespace=NAMESPACE)
    assert isinstance(answer, PodInjection), answer
    (chat,) = [
        c for c in build_plan("pool", NAMESPACE, granted_spec(), grants=grants).consumers if c.namespace
    ]
    assert answer.record["configHash"] == chat.config_hash and answer.record["deployment"] == "chat"
    pod = apply_merge_patch(tenant_pod("chat", ALLOW), answer.patch)
    assert pod["metadata"]["labels"][names.LABEL_POOL_NAMESPACE] == NAMESPACE
    assert pod["spec"]["volumes"][-1]["configMap"]["name"] == "pool-llm-connector"

    def refused(pod: dict[str, Any], pool: dict[str, Any] | None, **kwargs: Any) -> Refusal:
        found = admit_pod(pod, OTHER, pool, **{"grants": grants, "pool_namespace": NAMESPACE, **kwargs})
        assert isinstance(found, Refusal), found
        return found

    # A namespace the pool does not list: its grants give no consumer, whatever they list.
    unlisted = granted_spec()
    unlisted["tenancy"]["grantNamespaces"] = []
    found = refused(tenant_pod("chat", ALLOW), serving_pool(unlisted))
    assert found.rule == "not-a-consumer" and "spec.tenancy.grantNamespaces" in found.message
    # ... and learns nothing of the pool's state from the refusal (not ready, invalid, ...).
    down = serving_pool(unlisted)
    for item in down["status"]["conditions"]:
        if item["type"] == "MasterReady":
            item.update(status="False", message="secret-master-state")
    found = refused(tenant_pod("chat", ALLOW), down)
    assert found.rule == "not-a-consumer" and "secret-master-state" not in found.message
    broken = granted_spec()
    broken["tenancy"]["grantNamespaces"] = []
    broken["store"]["replicas"] = -1
    found = refused(tenant_pod("chat", ALLOW), serving_pool(broken))
    assert found.rule == "not-a-consumer", found
    # A Deployment the grant does not list, and the pool's own consumer's name in the grant's namespace.
    for name in ("stranger", "llm-0"):
        found = refused(tenant_pod(name, ALLOW), pool)
        assert found.rule == "not-a-consumer" and "MooncakeKVPoolGrant" in found.message
    # Consent names the pool's namespace: a pool of the same name in the Pod's is another one.
    only_pool = {names.LABEL_ALLOW_POOL: "pool"}
    found = refused(tenant_pod("chat", only_pool), pool)
    assert found.rule == "consent" and names.LABEL_ALLOW_POOL_NAMESPACE in found.message
    found = refused(tenant_pod("chat", only_pool), None, pool_namespace="", namespace_grants=grants[1:])
    assert found.rule == "consent" and f"{names.LABEL_ALLOW_POOL_NAMESPACE}={NAMESPACE}" in found.message
    assert refused(tenant_pod("chat", only_pool), None, pool_namespace="").rule == "no-pool"
    # The pool's own namespace: a Deployment named as the grant's consumer is another consumer.
    own = vllm_deployment("chat", allow_pool=None)
    own["spec"]["template"]["metadata"]["labels"].update(only_pool)
    namesake = admit_pod(replica_set_pod(own), NAMESPACE, pool, grants=grants)
    assert isinstance(namesake, Refusal) and namesake.rule == "not-a-consumer", namesake


def window_of(block_size: int) -> dict[str, Any]:
    """The consumer's layout with its window group's block size changed."""
    layout = json.loads(json.dumps(consumer()["layout"]))
    layout["groups"][1]["block_size"] = block_size
    return layout


@pytest.mark.parametrize(
    ("grant_obj", "field", "rule"),
    [
        (
            lambda: grant_with_consumers(consumer("chat"), namespace=NAMESPACE),
            "spec.consumers",
            "own-namespace-consumers",
        ),
        (
            lambda: grant_with_consumers(consumer("chat"), consumer("chat")),
            "spec.consumers[1].name",
            "consumer-unique",
        ),
        (
            lambda: grant_with_consumers({**consumer("chat"), "layout": window_of(15)}),
            "spec.consumers[0].layout.groups[1].block_size",
            "[hash-block-divisible]",  # the connector's own layout rule
        ),
    ],
)
def test_a_grant_with_bad_consumers_is_invalid_by_field_and_rule(
    grant_obj: Any, field: str, rule: str
) -> None:
    found = grant_obj()
    assert found.spec is None and found.problem.startswith(field) and rule in found.problem, found.problem
    status = grant_status(found, None)
    assert [(c["type"], c["status"], c["reason"]) for c in status["conditions"]] == [
        ("Accepted", "False", "Invalid")
    ]

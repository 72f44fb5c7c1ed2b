"""Status: rollout progress, conditions, phase."""

from __future__ import annotations

from typing import Any

from kvpool.connector.contract.layout import Problem
from kvpool.operator.status import (
    ConsumerState,
    condition_of,
    conflict_reason,
    conflicts_of,
    deployment_progress,
    invalid_status,
    valid_status,
)


def deployment(
    generation: int = 2, observed: int | None = 2, replicas: int = 2, updated: int = 2, available: int = 2
) -> dict[str, Any]:
    status: dict[str, Any] = {"updatedReplicas": updated, "availableReplicas": available}
    if observed is not None:
        status["observedGeneration"] = observed
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas}, "status": status}


def test_progress_needs_the_new_generation_observed_and_all_replicas() -> None:
    assert deployment_progress(deployment()).done
    assert not deployment_progress(deployment(observed=1)).done
    assert not deployment_progress(deployment(observed=None)).done
    assert not deployment_progress(deployment(updated=1)).done
    assert not deployment_progress(deployment(available=1)).done
    assert not deployment_progress(None).done
    assert "not yet observed" in deployment_progress(deployment(observed=1)).message


def test_progress_waits_for_old_pods_of_a_surge_rollout() -> None:
    """A RollingUpdate with surge: the new pod counts as updated while an old one is still
    available; the rollout is done only once the old pod is gone (status.replicas counts it)."""
    surging = deployment(replicas=1, updated=1, available=1)
    surging["status"]["replicas"] = 2
    progress = deployment_progress(surging)
    assert not progress.done
    assert "1 old replica" in progress.message
    surging["status"]["replicas"] = 1
    assert deployment_progress(surging).done


def valid(
    consumers: list[ConsumerState],
    old: dict[str, Any] | None = None,
    now: str = "t1",
    store: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return valid_status(
        master_address="m:1",
        master=deployment(),
        store=store or deployment(),
        embedded=False,
        consumers=consumers,
        old=old or {},
        generation=2,
        now=now,
    )


def test_all_ready_is_ready() -> None:
    status = valid([ConsumerState("llm", "h", "f", True, "ok")])
    assert status["phase"] == "Ready"
    assert status["observedGeneration"] == 2
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "ConfigValid": "True",
        "MasterReady": "True",
        "StoreReady": "True",
        "ConsumersRolledOut": "True",
        "Conflict": "False",
    }
    assert status["consumers"] == [
        {"name": "llm", "configHash": "h", "layoutFingerprint": "f", "rolledOut": True, "message": "ok"}
    ]


def test_pending_consumers_keep_it_progressing() -> None:
    status = valid([ConsumerState("llm", "h", "f", False, "1 updated")], store=deployment(available=0))
    assert status["phase"] == "Progressing"
    assert condition_of(status, "ConsumersRolledOut")["message"] == "waiting for: llm"
    assert condition_of(status, "StoreReady")["status"] == "False"


def test_transition_times_move_only_on_change() -> None:
    first = valid([ConsumerState("llm", "h", "f", False, "")], now="t1")
    second = valid([ConsumerState("llm", "h", "f", True, "")], old=first, now="t2")
    times = {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}
    assert times == {
        "ConfigValid": "t1",
        "MasterReady": "t1",
        "StoreReady": "t1",
        "ConsumersRolledOut": "t2",
        "Conflict": "t1",
    }
    assert valid([ConsumerState("llm", "h", "f", True, "")], old=second, now="t3") == second


def test_an_invalid_spec_keeps_the_other_conditions() -> None:
    ready = valid([ConsumerState("llm", "h", "f", True, "")])
    problem = Problem(
        field="spec.consumers[0].layout.groups[1].kind",
        rule="cross-attention",
        message="consumer 'llm': group 1 is cross attention",
    )
    status = invalid_status([problem], ready, 3, "t9")
    assert status["phase"] == "Invalid"
    valid_condition = condition_of(status, "ConfigValid")
    assert valid_condition["status"] == "False"
    assert valid_condition["reason"] == "InvalidLayout"
    assert valid_condition["message"] == str(problem)
    assert condition_of(status, "MasterReady")["status"] == "True"
    assert status["consumers"] == ready["consumers"]
    fresh = invalid_status([problem], {}, 1, "t1")
    assert condition_of(fresh, "MasterReady")["status"] == "Unknown"


def ha_status(master: dict[str, Any], leader: Any) -> dict[str, Any]:
    """A fresh HA pool's status with ``master`` (its Deployment) and what the leader check found."""
    return valid_status(
        master_address="etcd://e:2379",
        master=master,
        store=deployment(),
        embedded=False,
        consumers=[],
        old={},
        generation=1,
        now="t",
        ha=True,
        leader=leader,
    )


def test_ha_master_ready_means_a_leader_serves() -> None:
    from kvpool.operator.leader import LeaderView

    def ready(leader: LeaderView | None, master: dict[str, Any] | None = None) -> dict[str, Any]:
        status = ha_status(master or deployment(replicas=3, updated=3, available=3), leader)
        return dict(condition_of(status, "MasterReady") or {})

    serving = ready(LeaderView(True, "the leader at 10.0.0.7:50051 serves"))
    assert (serving["status"], serving["reason"]) == ("True", "LeaderServes")
    assert "10.0.0.7:50051" in serving["message"] and "3/3 replicas" in serving["message"]
    # Every master rolled out and ready, yet no leader serves: not ready.
    warming = ready(LeaderView(False, "the leader at 10.0.0.7:50051 does not serve yet (leader_warmup)"))
    assert (warming["status"], warming["reason"]) == ("False", "NoLeader")
    assert "leader_warmup" in warming["message"]
    # Every master of the current template, one not yet available: ready.
    one_starting = deployment(replicas=3, updated=3, available=2)
    starting = ready(LeaderView(True, "the leader at x serves"), one_starting)
    assert starting["status"] == "True" and "3 updated, 2 available of 3" in starting["message"]
    assert ready(LeaderView(True, "x"), deployment(observed=1))["reason"] == "Progressing"
    # Masters of the previous template still run: the leader may be one of them, without the
    # flags the consumers' new settings need, and it is to be replaced: not ready.
    one_rolled = deployment(replicas=3, updated=1, available=3)
    one_rolled["status"]["replicas"] = 3
    rolling = ready(LeaderView(True, "the leader at x serves"), one_rolled)
    assert (rolling["status"], rolling["reason"]) == ("False", "MastersRolling")
    assert "2 old replica(s)" in rolling["message"]
    # No leader while the masters are still starting: progressing, not a fault.
    early = ready(LeaderView(False, "no leader yet"), deployment(replicas=3, updated=3, available=1))
    assert (early["status"], early["reason"]) == ("False", "Progressing")


def test_an_ha_pool_whose_masters_run_and_none_leads_is_an_error() -> None:
    """etcd lost quorum, say: every master runs and answers, none leads: ``Error`` (it said
    ``Progressing``, so ``KVPoolError`` never fired), but not while the masters start."""
    from kvpool.operator.capacity import apply_observation
    from kvpool.operator.leader import LeaderView
    from kvpool.operator.observation import Observation

    def status_of(master: dict[str, Any]) -> dict[str, Any]:
        return ha_status(master, LeaderView(False, "no master leads"))

    poll = Observation(at="t", problem="no master leads", reason="NoLeader")
    running = status_of(deployment(replicas=3, updated=3, available=3))
    observed = apply_observation(running, running, poll, asked=True, external=False, expected=2, now="t")
    assert observed["phase"] == "Error"
    # The next pass (its status, then the same poll's) keeps it.
    again = apply_observation(running, observed, poll, asked=True, external=False, expected=2, now="t2")
    assert again["phase"] == "Error"
    starting = status_of(deployment(replicas=3, updated=3, available=1))
    assert (
        apply_observation(starting, starting, poll, asked=True, external=False, expected=2, now="t")["phase"]
        == "Progressing"
    )


def test_conflicts_name_each_object_and_block_ready() -> None:
    refusals = [
        "Deployment ns/web-master exists and is not this pool's (no ownerReference to it) [ownership]",
        "Deployment ns/llm needs the label kvpool.mooncake.io/allow-pool=web to take its settings [consent]",
    ]
    status = valid_status(
        master_address="m:1",
        master=None,
        store=deployment(),
        embedded=False,
        consumers=[],
        old={},
        generation=1,
        now="t",
        conflicts=refusals,
        blocked=frozenset({"master"}),
    )
    assert status["phase"] == "Conflict"
    conflict = condition_of(status, "Conflict")
    assert (conflict["status"], conflict["reason"]) == ("True", "Conflicts")
    assert conflicts_of(status) == refusals
    assert condition_of(status, "MasterReady")["reason"] == "Conflict"
    assert [conflict_reason(r) for r in refusals] == ["NotOwned", "ConsumerRefused"]


def test_a_store_scaled_to_zero_is_not_ready() -> None:
    """A store "0/0 updated and available" is no store at all: the pool holds no memory."""
    status = valid([], store=deployment(replicas=0, updated=0, available=0))
    store = condition_of(status, "StoreReady")
    assert (store["status"], store["reason"]) == ("False", "NoStorePods")
    assert status["phase"] == "Progressing"


def test_a_rollout_past_its_progress_deadline_is_stalled() -> None:
    stuck = deployment(updated=2, available=0)
    assert not deployment_progress(stuck).stalled
    stuck["status"]["conditions"] = [
        {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": "timed out",
        }
    ]
    progress = deployment_progress(stuck)
    assert progress.stalled and not progress.done and "timed out" in progress.message
    status = valid([ConsumerState("llm", "h", "f", False, progress.message, stalled=True)])
    rollout = condition_of(status, "ConsumersRolledOut")
    assert rollout["reason"] == "RolloutStalled" and rollout["message"].startswith(
        "llm did not become available"
    )

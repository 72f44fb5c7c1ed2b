"""The demo's engine runner reports every save its engine made, and the demo says what they
stored ("engine A stored N blocks").

Saves publish off the forward path, so the last ones may still be in flight when the last
request finishes: the runner reads the connector's records only after the engine's shutdown,
which drains them (``shutdown_timeout_s``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.connector.local.demo import stored_line
from kvpool.connector.local.engine import EngineOptions, EngineRun, run_engine_subprocess
from kvpool.connector.local.recording import recording_transfer_config
from testing.models import build_gemma3
from testing.prompts import BLOCK, P1


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.mark.engine
@pytest.mark.mooncake
def test_an_engine_run_reports_the_saves_still_in_flight_when_its_request_finished(
    gemma_dir: Path, pool_settings
) -> None:
    """One generated token: no step follows the prefill's, whose saves then publish while the
    request finishes; every full block of P1 is still reported, per group, saved or masked."""
    config = recording_transfer_config(pool_settings)
    run = run_engine_subprocess(EngineOptions(model=str(gemma_dir), kv_transfer_config=config), [[P1]], 1)
    saves = [t for t in run.transfers if t["operation"] == "save"]
    assert saves, "engine A's saves are in its records"
    full_blocks = len(P1) // BLOCK
    kinds = saves[0]["group_kinds"]
    for group, kind in enumerate(kinds):
        saved = sum(t["blocks"][group] for t in saves)
        masked = sum(t["masked"][group] for t in saves)
        assert saved + masked == full_blocks, f"group {group} ({kind}): {saved} saved, {masked} masked"
        if kind == "full":
            assert saved == full_blocks, f"group {group}: every full block of P1 saved"
    assert not [t["failures"] for t in saves if t["failures"]], "no save failed"


def save(blocks: tuple[int, ...], failures: dict[str, int] | None = None) -> dict[str, object]:
    return {"operation": "save", "blocks": blocks, "failures": failures or {}}


def test_the_stored_line_counts_every_save_and_names_what_it_could_not() -> None:
    run = EngineRun(batches=[], transfers=[save((10, 10, 10)), {"operation": "load", "blocks": (9, 2, 2)}])
    assert stored_line(run) == "engine A stored 30 blocks (per group: 10, 10, 10)"
    run = EngineRun(
        batches=[], transfers=[save((8, 9, 10), {"timeout": 3}), save((1, 0, 0))], unreported_saves=2
    )
    assert stored_line(run) == (
        "engine A stored 28 blocks (per group: 9, 9, 10), 3 not stored (failed), "
        "2 save(s) unreported at its shutdown (not counted)"
    )
    assert stored_line(EngineRun(batches=[])) == "engine A stored 0 blocks"

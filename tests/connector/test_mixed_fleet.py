"""A mixed fleet on one pool: deployments that differ in hash seed or model revision never share.

Engine A stores P1 with one block-hash seed. An engine with another seed, and
one with another model revision, serve P2 (sharing A's 288-token prefix): both
get zero pool hits and the reference output. An engine like A gets the hit
(positive control: the prefix is there to take).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testing.engine import EngineOptions, reference_tokens, run_engine_subprocess, transfer_config
from testing.models import build_gemma3
from testing.prompts import MAX_TOKENS, P1, P2, PREFIX_HIT

pytestmark = [pytest.mark.engine, pytest.mark.mooncake]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3(tmp_path_factory.mktemp("gemma3"))


def test_other_seed_or_revision_gets_no_hit_and_right_output(gemma_dir, pool_settings) -> None:
    reference = reference_tokens(gemma_dir, [P2], MAX_TOKENS)[0]
    config = transfer_config(pool_settings)
    seed_a = {"PYTHONHASHSEED": "11"}
    run_engine_subprocess(
        EngineOptions(model=str(gemma_dir), kv_transfer_config=config), [[P1]], MAX_TOKENS, env=seed_a
    )

    def serve_p2(env: dict[str, str], **llm_kwargs: object):
        opts = EngineOptions(model=str(gemma_dir), kv_transfer_config=config, llm_kwargs=dict(llm_kwargs))
        return run_engine_subprocess(opts, [[P2]], MAX_TOKENS, env=env).results[0]

    other_seed = serve_p2({"PYTHONHASHSEED": "12"})
    assert other_seed.num_cached_tokens == 0
    assert other_seed.token_ids == reference
    other_revision = serve_p2(seed_a, revision="other-revision")
    assert other_revision.num_cached_tokens == 0
    assert other_revision.token_ids == reference
    same = serve_p2(seed_a)
    assert same.num_cached_tokens == PREFIX_HIT
    assert same.token_ids == reference

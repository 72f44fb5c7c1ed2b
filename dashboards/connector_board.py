"""The Connector dashboard: what the KV connector in each vLLM engine asked, got, moved and lost."""

from __future__ import annotations

from dashboards import external as ext
from dashboards.board import Board, Target, Variable
from dashboards.conventions import (
    ENGINE,
    MODEL,
    NAMESPACE,
    POOL,
    VAR_ENGINE,
    VAR_MODEL,
    VAR_NAMESPACE,
    VAR_POOL,
    selector,
)
from dashboards.promql import by, quantile, ratio, sum_rate
from kvpool.connector.contract import metric_names as m
from kvpool.connector.pool_client import Outcome

UID = "kvpool-connector"
SEL = selector(VAR_NAMESPACE, VAR_POOL, VAR_MODEL, VAR_ENGINE)
# Not a failure: a save that found its key reserved by another writer (two engines saving the
# same shared prefix at once); the other's copy lands. Shown by kind, never counted as failed.
NOT_FAILED = (Outcome.IN_FLIGHT,)
GROUP = ["group", "group_kind"]
# One engine: vLLM numbers each server's engines from 0, so its scrape target (``instance``)
# tells the servers (the consumer's replicas) apart.
ONE_ENGINE = [MODEL, ENGINE, "instance"]


def _sel(**fixed: str) -> str:
    return selector(VAR_NAMESPACE, VAR_POOL, VAR_MODEL, VAR_ENGINE, **fixed)


def _hit_rate(hits: str, queries: str, labels: list[str]) -> str:
    return ratio(sum_rate(hits, SEL, labels), sum_rate(queries, SEL, labels))


def _with(sel: str, *matchers: str) -> str:
    """``sel`` with more ``matchers`` (``label!~"..."`` and the like)."""
    return sel[:-1] + "".join(f", {matcher}" for matcher in matchers) + "}"


NOT_FAILED_MATCHER = f'reason!~"{"|".join(NOT_FAILED)}"'
TRANSFERS = f'operation=~"{m.LOAD}|{m.SAVE}"'


def _failed_share(labels: list[str]) -> str:
    """Keys loaded or saved that failed over those tried (moved or failed), every rank's: 0
    where none failed; where none moved, the failed keys are all that was tried; none where
    none was tried (idle)."""
    failed = sum_rate(m.FAILURES.exported, _with(SEL, TRANSFERS, NOT_FAILED_MATCHER), labels)
    tried = sum_rate(m.FAILURES.exported, _with(SEL, TRANSFERS), labels)
    moved = sum_rate(m.TRANSFER_KEYS.exported, _with(SEL, TRANSFERS), labels)
    return ratio(
        f"(\n{failed}\nor {moved} * 0\n)", f"(\n({moved} or {tried} * 0)\n+ ({tried} or {moved} * 0)\n)"
    )


def build() -> Board:
    by_model = [MODEL]
    variables = [
        Variable(VAR_NAMESPACE, NAMESPACE, m.LOOKUPS.exported),
        Variable(VAR_POOL, POOL, m.LOOKUPS.exported, selector(VAR_NAMESPACE)),
        Variable(VAR_MODEL, MODEL, m.LOOKUPS.exported, selector(VAR_NAMESPACE, VAR_POOL)),
        Variable(VAR_ENGINE, ENGINE, m.LOOKUPS.exported, selector(VAR_NAMESPACE, VAR_POOL, VAR_MODEL)),
    ]
    board = Board(
        UID,
        "KV pool / Connector",
        "The KVPoolConnector in each vLLM engine: per-group hit rate, masked blocks, transfer "
        "latency and bytes, failures; vLLM's own prefix-cache hit rates beside ours.",
        variables,
    )
    hma_hit = _hit_rate(m.LOOKUP_HIT_TOKENS.exported, m.LOOKUP_QUERY_TOKENS.exported, by_model)

    board.row("Overview")
    board.stat(
        "Pool hit rate",
        "Tokens the pool held for the reconciled hybrid (HMA) hit, over tokens looked up past the "
        "local prefix cache's hit. Hits the connector recomputed as faster count too; the prefill "
        "the pool saved: 'Prompt tokens by where their KV came from'.",
        [Target(_hit_rate(m.LOOKUP_HIT_TOKENS.exported, m.LOOKUP_QUERY_TOKENS.exported, []))],
        unit="percentunit",
    )
    board.stat(
        "Lookups per second",
        "Scheduler lookups against the pool.",
        [Target(sum_rate(m.LOOKUPS.exported, SEL))],
        unit="reqps",
    )
    board.stat(
        "Loaded per second",
        "Bytes loaded from the pool into vLLM's KV cache.",
        [Target(sum_rate(m.TRANSFER_BYTES.exported, _sel(operation=m.LOAD)))],
        unit="binBps",
    )
    board.stat(
        "Failed keys per second",
        "Keys whose load or save failed, every rank's, all kinds but in_flight (a save that found "
        "its key being saved by another engine: its copy lands). Failed lookups count one per "
        "lookup, not per key, so they are left out; 'Failed keys by kind' shows both.",
        [Target(sum_rate(m.FAILURES.exported, _with(SEL, TRANSFERS, NOT_FAILED_MATCHER)))],
        unit="short",
    )

    board.row("Hit rate")
    board.timeseries(
        "Pool hit rate beside vLLM's prefix caches",
        "Ours: tokens the pool held for the hybrid hit over tokens looked up past the local hit. "
        "vLLM's external prefix cache: the tokens vLLM loaded of them, over the same tokens (hits "
        "recomputed as faster left out). Its local prefix cache: its own (GPU-resident) hits over "
        "all prompt tokens.",
        [
            Target(hma_hit, "{{model_name}} pool (HMA hit)"),
            Target(
                _hit_rate(
                    ext.total(ext.VLLM_EXTERNAL_PREFIX_CACHE_HITS),
                    ext.total(ext.VLLM_EXTERNAL_PREFIX_CACHE_QUERIES),
                    by_model,
                ),
                "{{model_name}} vLLM external prefix cache",
            ),
            Target(
                _hit_rate(
                    ext.total(ext.VLLM_PREFIX_CACHE_HITS), ext.total(ext.VLLM_PREFIX_CACHE_QUERIES), by_model
                ),
                "{{model_name}} vLLM local prefix cache",
            ),
        ],
        unit="percentunit",
        max_value=1,
    )
    board.timeseries(
        "Hit rate per KV-cache group, and the HMA hit",
        "Tokens each group alone could have served from the pool, over tokens looked up; the HMA "
        "hit is what all groups together granted. A group far above the HMA hit is held back by "
        "another group.",
        [
            Target(
                ratio(
                    sum_rate(m.GROUP_HIT_TOKENS.exported, SEL, [MODEL, *GROUP]),
                    sum_rate(m.LOOKUP_QUERY_TOKENS.exported, SEL, by_model),
                    on=by_model,
                    group_left=True,
                ),
                "{{model_name}} group {{group}} ({{group_kind}})",
            ),
            Target(hma_hit, "{{model_name}} HMA hit"),
        ],
        unit="percentunit",
        max_value=1,
    )
    board.timeseries(
        "Blocks present in the pool, and blocks the hit uses, per group",
        "Past vLLM's local prefix hit. Present: blocks of the looked-up prefix found in the pool. "
        "Used: blocks the reconciled hit loads (after the group's mask). One line per model and "
        "group: a group index is its model's own.",
        [
            Target(
                sum_rate(m.PRESENT_BLOCKS.exported, SEL, [MODEL, *GROUP]),
                "{{model_name}} present: group {{group}} ({{group_kind}})",
            ),
            Target(
                sum_rate(m.HIT_BLOCKS.exported, SEL, [MODEL, *GROUP]),
                "{{model_name}} used: group {{group}} ({{group_kind}})",
            ),
        ],
        unit="short",
    )
    board.timeseries(
        "Share of present blocks the hit uses, per group",
        "How much of each group's raw presence survives the hybrid intersection and the group's "
        "mask (a sliding-window group needs only its window, a Mamba group its last state).",
        [
            Target(
                ratio(
                    sum_rate(m.HIT_BLOCKS.exported, SEL, [MODEL, *GROUP]),
                    sum_rate(m.PRESENT_BLOCKS.exported, SEL, [MODEL, *GROUP]),
                ),
                "{{model_name}} group {{group}} ({{group_kind}})",
            )
        ],
        unit="percentunit",
        max_value=1,
    )

    prompt_tokens = ext.total(ext.VLLM_PROMPT_TOKENS_BY_SOURCE)
    by_source = [MODEL, "source"]
    skipped = _with(SEL, f'source=~"{ext.PROMPT_LOCAL_CACHE}|{ext.PROMPT_LOADED}"')
    board.timeseries(
        "Prompt tokens by where their KV came from",
        f"Prompt tokens per second the engines prefilled ({ext.PROMPT_COMPUTED}), took from their "
        f"own prefix cache ({ext.PROMPT_LOCAL_CACHE}) or loaded from the pool ({ext.PROMPT_LOADED}, "
        "pool hits recomputed as faster not included): the last two are prefill skipped. vLLM's "
        "own count.",
        [Target(sum_rate(prompt_tokens, SEL, by_source), "{{model_name}} {{source}}")],
        stacked=True,
    )
    board.timeseries(
        "Share of prompt tokens whose prefill was skipped",
        "Prompt tokens taken from the engine's own prefix cache, and loaded from the pool, over all "
        "prompt tokens: the prefill the pool saved beside what the local cache saved.",
        [
            Target(
                ratio(
                    sum_rate(prompt_tokens, skipped, by_source),
                    sum_rate(prompt_tokens, SEL, by_model),
                    on=by_model,
                    group_left=True,
                ),
                "{{model_name}} {{source}}",
            )
        ],
        unit="percentunit",
        max_value=1,
    )

    board.row("Transfers")
    board.timeseries(
        "Masked blocks per group, on load and save",
        "Blocks a transfer covers but the group's mask leaves in place (load: outside the window "
        "or before the last Mamba state; save: no future hit could load them).",
        [
            Target(
                sum_rate(m.MASKED_BLOCKS.exported, SEL, [MODEL, "operation", *GROUP]),
                "{{model_name}} {{operation}}: group {{group}} ({{group_kind}})",
            )
        ],
    )
    board.timeseries(
        "Blocks moved per group",
        "Blocks loaded from and saved to the pool.",
        [
            Target(
                sum_rate(m.TRANSFER_BLOCKS.exported, SEL, [MODEL, "operation", *GROUP]),
                "{{model_name}} {{operation}}: group {{group}} ({{group_kind}})",
            )
        ],
    )
    board.timeseries(
        "Bytes per second",
        "Bytes loaded and saved, by group kind.",
        [
            Target(
                sum_rate(m.TRANSFER_BYTES.exported, SEL, ["operation", "group_kind"]),
                "{{operation}} {{group_kind}}",
            )
        ],
        unit="binBps",
    )
    board.timeseries(
        "Latency p50 and p99 by operation and group kind",
        "Lookups (group kind 'all'), and each group's load and save per request.",
        [
            Target(
                quantile(q, m.OPERATION_SECONDS.exported, SEL, ["operation", "group_kind"]),
                f"p{int(q * 100)} {{{{operation}}}} {{{{group_kind}}}}",
            )
            for q in (0.5, 0.99)
        ],
        unit="s",
    )
    board.timeseries(
        "Bytes per request p50 and p99",
        "Bytes one request's load or save moved, all groups and every tensor and pipeline rank.",
        [
            Target(
                quantile(q, m.TRANSFER_SIZE_BYTES.exported, SEL, ["operation"]),
                f"p{int(q * 100)} {{{{operation}}}}",
            )
            for q in (0.5, 0.99)
        ],
        unit="bytes",
    )

    board.timeseries(
        "Steps a request waited for its lookup",
        "Scheduler steps vLLM skipped a request while its lookup was in flight (answered past "
        "the step's lookup_budget_ms), per lookup: each delays the request's first token by one "
        "step of the other requests' forward.",
        [
            Target(
                ratio(
                    sum_rate(m.LOOKUP_DEFERRED_STEPS.exported, SEL, by_model),
                    sum_rate(m.LOOKUPS.exported, SEL, by_model),
                ),
                "{{model_name}}",
            )
        ],
        unit="short",
    )

    board.row("Load or recompute")
    board.timeseries(
        "Pool hits loaded or recomputed",
        "What the connector did with each pool hit, and why: estimate (the estimated load and "
        "recompute times compared), probe (recompute estimated faster, loaded to measure the link "
        "again), floor (too few observations to trust the rates: loaded), forced (load_policy).",
        [
            Target(
                sum_rate(m.LOAD_DECISIONS.exported, SEL, [MODEL, "decision", "basis"]),
                "{{model_name}} {{decision}} ({{basis}})",
            )
        ],
        unit="reqps",
        width=8,
    )
    board.timeseries(
        "Hit tokens recomputed because it was faster",
        "Tokens the pool held that requests recomputed because recomputing them was estimated "
        "faster than loading them (load_policy auto).",
        [Target(sum_rate(m.LOAD_SKIPPED_TOKENS.exported, SEL, by_model), "{{model_name}}")],
        unit="short",
        width=8,
    )
    board.timeseries(
        "Rates the decision uses",
        "Load rate (bytes the workers loaded over their load time, per transport; bytes/s) and "
        "prefill rate (tokens the engine's prefilling steps computed over their wall time; "
        "tokens/s), learned online; a hit loads when its bytes over the first beat its tokens "
        "over the second by load_margin. One line per engine of each server (its scrape target).",
        [
            Target(
                f"max{by([*ONE_ENGINE, 'transport'])} ({m.LOAD_RATE.exported}{SEL})",
                "{{model_name}} {{instance}} engine {{engine}} load over {{transport}}",
                unit="binBps",
            ),
            Target(
                f"max{by(ONE_ENGINE)} ({m.PREFILL_RATE.exported}{SEL})",
                "{{model_name}} {{instance}} engine {{engine}} prefill (tokens/s)",
            ),
        ],
        unit="short",
        width=8,
    )

    board.row("Failures")
    board.timeseries(
        "Failed keys by kind",
        "missing: gone between lookup and load; store_full: no space to save; transfer_failed and "
        "rpc_failed: the transfer engine or the master failed; timeout: past the connector's deadline "
        "(a frozen master or store; a lookup then misses); corrupt: an object that is not its block; "
        "quota_exceeded and tenant_not_registered: the master refused a save of the tenant; "
        "in_flight (not a failure): another engine was saving the same key, and its copy lands.",
        [
            Target(
                sum_rate(m.FAILURES.exported, SEL, ["operation", "reason", "group_kind"]),
                "{{operation}} {{reason}} ({{group_kind}})",
            )
        ],
    )
    board.timeseries(
        "Share of keys that failed",
        "Keys whose load or save failed (in_flight left out) over the keys tried (moved plus "
        "failed), every rank's: a tensor-parallel engine moves one key per rank and block. "
        "KVPoolLoadErrorsRising pages on the load share, KVPoolSaveErrors on the save share (with "
        "more reasons left out).",
        [Target(_failed_share([MODEL, "operation"]), "{{model_name}} {{operation}}")],
        unit="percentunit",
        max_value=1,
    )
    board.timeseries(
        "Objects removed from the pool",
        "Objects the connector removed, by reason (corrupt: a loaded object whose header named "
        "another layout, block, group or rank, whose size was wrong, or whose payload was not "
        "the one its header states: damaged, or read before its write landed).",
        [
            Target(
                sum_rate(m.REMOVED_OBJECTS.exported, SEL, ["reason", "group_kind"]),
                "{{reason}} ({{group_kind}})",
            )
        ],
    )
    board.timeseries(
        "Handed back to vLLM for recompute",
        "Blocks whose load failed and that vLLM recomputes (single-group layouts), and requests a "
        "failed load sent back to recompute (hybrid layouts). Never wrong KV, never a stuck request.",
        [
            Target(sum_rate(m.LOAD_ERROR_BLOCKS.exported, SEL, by_model), "{{model_name}} blocks"),
            Target(sum_rate(m.RECOMPUTED_REQUESTS.exported, SEL, by_model), "{{model_name}} requests"),
        ],
    )
    board.timeseries(
        "Engines out of the pool: declared layout differs",
        "Fields in which the KV layout declared for an engine differs from the one vLLM built (one "
        "series per engine of each server, its scrape target, and field). Such an engine never "
        "uses the pool; fix the consumer's layout in the MooncakeKVPool (kvpool-layout prints it).",
        [
            Target(
                f"sum{by([*ONE_ENGINE, 'field'])} ({m.LAYOUT_MISMATCHES.exported}{SEL})",
                "{{model_name}} {{instance}} engine {{engine}}: {{field}}",
            )
        ],
    )
    board.timeseries(
        "Engines out of the pool",
        "Engines serving without the pool (one series per model): their Mooncake master did not "
        "serve when they started and they have not joined it yet (each tries every 5 s), or their "
        "declared layout differs (the panel beside). Their output is right; they only compute "
        "every prefix themselves. An engine sends this when it steps: one that joined while idle "
        "shows out until its next request.",
        [Target(f"sum{by([MODEL])} (1 - {m.IN_POOL.exported}{SEL})", "{{model_name}}")],
    )
    board.stat(
        "Engines per key fingerprint",
        "Engines share pool entries only when the fingerprint in their keys is equal. One value per "
        "fingerprint (its engines); two where one was expected: compare the inputs in the legend "
        "(every input is a label of vllm:kvpool_key_fingerprint_info).",
        [
            Target(
                f"count{by(list(m.FINGERPRINT_LABELS))} ({m.KEY_FINGERPRINT_INFO.exported}{SEL})",
                "{{fingerprint}}: {{model}} {{dtype}} {{groups}} {{parallel}} cache {{cache_dtype}} "
                "rev {{model_revision}} quant {{weight_quantization}} hash {{block_hash_algorithm}} "
                "seed {{block_hash_seed}}",
            )
        ],
        width=12,
        height=8,
    )
    return board

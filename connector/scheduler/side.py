"""Scheduler half of the connector: lookups, load plans and save plans.

``get_num_new_matched_tokens`` runs the hybrid fixed point over what the pool
holds, asking the master only about the blocks it reads, and remembers a load
plan. Lookups are batched (``lookups``) and asked on the presence service's thread
(``presence``): a request's first call queues its lookup, hands it to that thread and
waits for the answer within what is left of the step's lookup budget; past it, it
answers ``None`` (vLLM skips it this step), the step's other lookups go to the master
together when scheduling ends, and the request's next call takes the answer;
``update_state_after_alloc`` pins the plan to the blocks vLLM allocated; ``build_connector_meta`` hands each
step's loads and the saves of newly computed blocks to the workers. What the side
keeps of a request is one :class:`RequestState`, forgotten in ``request_finished``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_coordinator import replay_boundaries
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

from kvpool.connector.contract.keys import KeySpace, hash_digest
from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.integrity.deadlines import IDLE_STEP_WAIT_S
from kvpool.connector.metadata import (
    GroupTransfer,
    PoolConnectorMetadata,
    RequestLoad,
    RequestSave,
)
from kvpool.connector.observability import tracing
from kvpool.connector.observability.logs import get_logger
from kvpool.connector.observability.records import Deferred, LookupRecord, StatsCollector
from kvpool.connector.observability.vllm_metrics import decision_data, transfer_sample
from kvpool.connector.pool_client import Outcome, PoolClient
from kvpool.connector.scheduler.hybrid_hit import HybridHit, HybridHitCoordinator
from kvpool.connector.scheduler.load_decision import LoadPolicy, Verdict, decide
from kvpool.connector.scheduler.load_rates import LoadRates
from kvpool.connector.scheduler.lookup_statistics import lookup_statistics
from kvpool.connector.scheduler.lookups import Lookup, LookupQuery
from kvpool.connector.scheduler.presence import PendingLookup, PresenceService
from kvpool.connector.scheduler.request_state import (
    LoadPlan,
    LookedUp,
    RequestState,
    SaveProgress,
)

logger = get_logger(__name__)

_DEFAULTS = ConnectorSettings.model_fields
LOOKUP_TIMEOUT_S: float = _DEFAULTS["lookup_timeout_s"].default
LOOKUP_BUDGET_S: float = _DEFAULTS["lookup_budget_ms"].default / 1000
LOAD_MARGIN: float = _DEFAULTS["load_margin"].default
LOAD_DECISION_MIN_SAMPLES: int = _DEFAULTS["load_decision_min_samples"].default


class SchedulerSide:
    """Scheduler-process state of ``KVPoolConnector``."""

    def __init__(
        self,
        *,
        client: PoolClient,
        keyspace: KeySpace,
        tp_size: int,
        pp_size: int,
        group_shards: Sequence[int] = (),
        save_decode_cache: bool = False,
        can_load: bool,
        can_save: bool,
        stats: StatsCollector,
        lookup_timeout_s: float = LOOKUP_TIMEOUT_S,
        lookup_budget_s: float = LOOKUP_BUDGET_S,
        idle_step_wait_s: float = IDLE_STEP_WAIT_S,
        load_policy: LoadPolicy | str = LoadPolicy.AUTO,
        load_margin: float = LOAD_MARGIN,
        load_decision_min_samples: int = LOAD_DECISION_MIN_SAMPLES,
        transport: str = "tcp",
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.client = client
        self.keyspace = keyspace
        self.tp_size = tp_size
        self.pp_size = pp_size
        # Per group: the objects of a block per pipeline stage (contract.shards); tp_size if unset.
        self.group_shards = tuple(group_shards)
        # Prompts are what requests share; blocks a request completes while decoding
        # are saved only when asked for.
        self.save_decode_cache = save_decode_cache
        self.can_load = can_load
        self.can_save = can_save
        self.stats = stats
        self.lookup_timeout_s = lookup_timeout_s
        # What one step may still wait for its new requests' lookups (reset as each step ends).
        self.lookup_budget_s = lookup_budget_s
        self._step_budget_left_s = lookup_budget_s
        self.idle_step_wait_s = idle_step_wait_s
        # Every existence check, on one thread. The client is bound on first use: a
        # connector out of the pool has a client with no calls at all.
        self.presence = PresenceService(
            lambda keys: self.client.presence(keys), self._conclude, lookup_timeout_s
        )
        self.coordinator: HybridHitCoordinator | None = None
        self._hit_unit = 1  # set with the coordinator (bind)
        # What the side keeps of each request, by id, until it finishes.
        self.requests: dict[str, RequestState] = {}
        # The requests that may still complete a block to save (decode steps of prompts
        # saved in full look at none): an index into ``requests``.
        self._saving: dict[str, SaveProgress] = {}
        self._pending_loads: list[RequestLoad] = []
        self._key_prefixes: dict[int, tuple[str, ...]] = {}
        # Load or recompute each hit (load_decision), from rates learned online (load_rates).
        self.load_policy = LoadPolicy(load_policy)
        self.load_margin = load_margin
        self.load_decision_min_samples = load_decision_min_samples
        self.transport = transport
        self.rates = LoadRates(clock=clock)
        self._block_sizes: tuple[int, ...] = ()
        self._decisions: dict[tuple[str, str], int] = {}  # (decision, basis) -> requests, to export
        self._skipped_tokens = 0  # hit tokens recomputed as cheaper, to export
        self._recomputed_in_a_row = 0  # hits recomputed on the estimate since the last that loaded

    def bind(self, vllm_coordinator: Any) -> None:
        """Mirror vLLM's live coordinator (called once the cache manager exists)."""
        self.coordinator = HybridHitCoordinator.from_vllm_coordinator(vllm_coordinator)
        self._hit_unit = hit_unit(self.coordinator)
        self._block_sizes = tuple(g.block_size for g in self.coordinator.groups)
        # A step prefills when it computes at least a hit unit beyond one token per request.
        self.rates.min_prefill_tokens = self._hit_unit

    # --- lookup ------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        coord = self.coordinator
        req_id = request.request_id
        state = self.requests.get(req_id)
        if self.can_save:  # its saves start past vLLM's own hit, whatever the pool answers
            if state is None:
                state = self.requests[req_id] = RequestState()
            state.local_tokens = num_computed_tokens
        if not self.can_load or coord is None or (state is not None and state.load_failed):
            return 0, False
        if self.load_policy is LoadPolicy.NEVER:
            return 0, False  # every hit recomputes: nothing to ask, admitted now
        if (request.num_tokens - 1) // self._hit_unit * self._hit_unit <= num_computed_tokens:
            return 0, False  # nothing the pool could add: admitted now, not a step later
        if state is None:
            state = self.requests[req_id] = RequestState()
        # A request vLLM could not allocate yet comes back: its lookup stands until
        # its blocks are allocated, without asking the master or counting it again.
        looked_up = state.looked_up
        if looked_up is not None and self._stale(looked_up):
            looked_up = None  # the pool may have changed since: ask again
        if looked_up is not None and looked_up.num_tokens == request.num_tokens:
            return self._grant(state, looked_up, num_computed_tokens)
        answered = self._take_answer(coord, state, request, num_computed_tokens)
        if answered is None:
            return None, False  # in flight: vLLM skips the request this step
        query, record, looked_up = answered
        granted = self._grant(state, looked_up, num_computed_tokens)
        # Kept and counted only once granted: a lookup that raised before is counted failed
        # by the connector (a retry asks again, a new lookup), never as a hit besides.
        state.looked_up = looked_up
        self._trace(query, record)
        self.stats.record_lookup(record, request)
        return granted

    def _grant(self, state: RequestState, looked_up: LookedUp, num_computed_tokens: int) -> tuple[int, bool]:
        """What ``looked_up``'s hit adds past vLLM's own ``num_computed_tokens``, loaded or
        recomputed (the request's plan set accordingly)."""
        state.local_tokens = num_computed_tokens
        num_external = max(0, looked_up.hit.hit_tokens - num_computed_tokens)
        if num_external == 0:
            state.plan = None
            return 0, False
        verdict = looked_up.verdict
        if verdict is None:
            verdict = looked_up.verdict = self._decide(looked_up, num_computed_tokens, num_external)
        if not verdict.load:
            state.plan = None
            return 0, False  # recomputing it is faster: a miss
        state.plan = LoadPlan(looked_up.hit, num_computed_tokens, looked_up.digests)
        # Always asynchronous: vLLM then caches the request's blocks only once the load
        # is reported finished, and only those it delivered. A block of a failed load
        # never becomes a local prefix hit, whatever happens to the request meanwhile.
        return num_external, True

    def _decide(self, looked_up: LookedUp, local_tokens: int, num_external: int) -> Verdict:
        """Load ``looked_up``'s hit past ``local_tokens``, or recompute it (counted for export)."""
        policy = self.load_policy
        if policy is LoadPolicy.AUTO:
            hit_bytes = self.rates.hit_bytes(looked_up.hit.needed_blocks, self._block_sizes, local_tokens)
            rates = self.rates.rates(self.transport)
        else:
            hit_bytes, rates = None, self.rates.rates("")
        verdict = decide(
            policy,
            hit_tokens=num_external,
            hit_bytes=hit_bytes,
            rates=rates,
            margin=self.load_margin,
            min_samples=self.load_decision_min_samples,
            recomputed_in_a_row=self._recomputed_in_a_row,
        )
        self._decisions[verdict.labels] = self._decisions.get(verdict.labels, 0) + 1
        if verdict.load:
            self._recomputed_in_a_row = 0
        else:
            self._recomputed_in_a_row += 1
            self._skipped_tokens += num_external
        return verdict

    def _stale(self, looked_up: LookedUp) -> bool:
        """Whether a kept answer is older than ``lookup_timeout_s`` (memory pressure kept the
        request waiting): its blocks may have left the pool since."""
        return time.perf_counter() - looked_up.answered_at > self.lookup_timeout_s

    def _take_answer(
        self, coord: HybridHitCoordinator, state: RequestState, request: Any, num_computed_tokens: int
    ) -> tuple[LookupQuery, LookupRecord, LookedUp] | None:
        """The answer to ``request``'s queued lookup; None while it is in flight (a request
        with none, or one of another length, is queued now)."""
        pending = state.pending
        if (
            pending is not None
            and pending.outcome is not None
            and self._stale(pending.outcome[1])
            and not state.asked_again
        ):
            state.asked_again = True
            pending = None  # answered, but the request was not reached for a while: ask again, once
        if pending is None or pending.lookup.query.num_tokens != request.num_tokens:
            state.cancel_lookup()
            query = self._query(request, num_computed_tokens)
            pending = state.pending = self.presence.queue(
                Lookup(coord, query, self._rank_prefixes, self._ranks)
            )
            self._wait_within_budget(pending)
        query = pending.lookup.query
        answered = pending.answered
        if not answered and time.perf_counter() < query.deadline:
            pending.deferred_steps += 1
            return None
        state.cancel_lookup()
        state.asked_again = False
        if answered and pending.outcome is not None:
            record, looked_up = pending.outcome
            record.deferred_steps = pending.deferred_steps
            return query, record, looked_up
        # Past its deadline (or its batch failed, or it was refused): a miss.
        if not answered:
            logger.warning(
                "KVPoolConnector lookup passed its %.2f s deadline unanswered: a miss", self.lookup_timeout_s
            )
        lookup = pending.lookup
        miss = HybridHit(0, tuple(() for _ in coord.groups), lambda: tuple(0 for _ in coord.groups))
        record, looked_up = self._record(
            lookup, miss, {g: {} for g in lookup.wanted}, {Outcome.TIMEOUT.value: 1}, 0
        )
        record.deferred_steps = pending.deferred_steps
        return query, record, looked_up

    def _wait_within_budget(self, pending: PendingLookup) -> None:
        """Ask the master about ``pending`` now and wait for its answer, within what is left of
        this step's lookup budget (and its deadline): answered in time, the request is admitted
        this step; not, it defers a step and takes the late answer then, as any deferred one."""
        left = min(self._step_budget_left_s, pending.lookup.query.deadline - time.perf_counter())
        if left <= 0:
            return  # the step's budget is spent: flushed with the step's other lookups
        started = time.perf_counter()
        self.presence.flush()
        self.presence.wait_answered(pending, left)
        self._step_budget_left_s -= time.perf_counter() - started

    def _query(self, request: Any, num_computed_tokens: int) -> LookupQuery:
        """What the lookup needs of ``request`` (which vLLM's scheduler thread mutates), copied."""
        now = time.perf_counter()
        return LookupQuery(
            req_id=request.request_id,
            block_hashes=list(request.block_hashes),
            num_tokens=request.num_tokens,
            num_computed_tokens=num_computed_tokens,
            trace_context=self.stats.trace_context(request),
            started=now,
            started_ns=time.time_ns(),
            deadline=now + self.lookup_timeout_s,
        )

    def _conclude(self, lookup: Lookup) -> tuple[LookupRecord, LookedUp]:
        """An answered lookup's record and what the request keeps of it (on the presence
        service's thread)."""
        assert lookup.result is not None
        hit, known = lookup.result
        return self._record(lookup, hit, known, lookup.failures, lookup.asked_keys)

    def _record(
        self,
        lookup: Lookup,
        hit: HybridHit,
        known: dict[int, dict[int, bool]],
        failures: dict[str, int],
        asked_keys: int,
    ) -> tuple[LookupRecord, LookedUp]:
        query = lookup.query
        num_computed_tokens = query.num_computed_tokens
        num_external = max(0, hit.hit_tokens - num_computed_tokens)
        statistics = lookup_statistics(lookup, known, None if failures else self.presence.ask, self._ranks)
        present: Sequence[int]
        group_hits: Sequence[int]
        if callable(statistics):  # waiting for their own existence check: read when exported
            read = statistics
            present, group_hits = Deferred(lambda: read()[0]), Deferred(lambda: read()[1])
        else:
            present, group_hits = statistics
        groups = range(len(lookup.coord.groups))
        record = LookupRecord(
            query_tokens=max(0, query.num_tokens - num_computed_tokens),
            hit_tokens=num_external,
            group_kinds=self.stats.group_kinds,
            looked_up_blocks=tuple(len(lookup.wanted.get(g, ())) for g in groups),
            present_blocks=present,
            needed_blocks=hit.blocks_past(num_computed_tokens, [g.block_size for g in lookup.coord.groups]),
            group_hit_tokens=group_hits,
            # Batched: from the request's first call until its answer.
            seconds=time.perf_counter() - query.started,
            keys=asked_keys,
            failures=failures,
        )
        return record, LookedUp(hit, lookup.digests, query.num_tokens, complete=not failures)

    def _trace(self, query: LookupQuery, record: LookupRecord) -> None:
        """The lookup's span, from the request's first call until its answer was taken."""
        if not tracing.enabled():
            return
        with tracing.span(
            "kvpool.lookup",
            query.trace_context,
            start_time_ns=query.started_ns,
            request_id=query.req_id,
            groups=self.stats.group_kinds,
        ) as span:
            if span.is_recording():
                tracing.set_attributes(
                    span,
                    query_tokens=record.query_tokens,
                    hit_tokens=record.hit_tokens,
                    keys=record.keys,
                    looked_up_blocks=record.looked_up_blocks,
                    present_blocks=record.present_blocks,
                    hit_blocks=record.needed_blocks,
                    group_hit_tokens=tuple(record.group_hit_tokens),
                )
                tracing.mark_failed(span, record.failures)

    def _ranks(self, group_id: int) -> int:
        return len(self._rank_prefixes(group_id))

    def _rank_prefixes(self, group_id: int) -> tuple[str, ...]:
        """Every shard's key prefix in ``group_id`` (one per rank unless ranks hold copies), computed once."""
        prefixes = self._key_prefixes.get(group_id)
        if prefixes is None:
            shards = self.group_shards[group_id] if self.group_shards else self.tp_size
            prefixes = self.keyspace.rank_prefixes(group_id, shards, self.pp_size)
            self._key_prefixes[group_id] = prefixes
        return prefixes

    def close(self) -> None:
        self.presence.close()

    # --- allocation ------------------------------------------------------------
    def update_state_after_alloc(
        self, request: Any, block_ids_of: Callable[[], Sequence[list[int]]], num_external: int
    ) -> None:
        """Note ``request``'s allocation: where its saves start, and its load of ``num_external``
        tokens (``block_ids_of``: its block ids per group, asked only for a load)."""
        req_id = request.request_id
        state = self.requests.get(req_id)
        plan: LoadPlan | None = None
        local_tokens = request.num_computed_tokens
        pool_tokens: int | None = None  # what the pool holds of the prompt, where its lookup could tell
        if state is not None:  # its lookup is spent (one vLLM scheduled without its answer too)
            state.cancel_lookup()
            if state.looked_up is not None and state.looked_up.complete:
                pool_tokens = state.looked_up.hit.hit_tokens
            state.looked_up = None
            plan, state.plan = state.plan, None
            if state.local_tokens is not None:
                local_tokens, state.local_tokens = state.local_tokens, None
        if self.can_save and self.coordinator is not None:
            # Blocks the request starts with (local or pool hit) need no saving;
            # after a failed load, the blocks it recomputes instead do. Where its lookup
            # told what the pool holds, saves start there: the blocks of its local hit the
            # pool lacks (a store restarted, a master failed over, eviction) are saved again
            # from the local cache, so that the pool heals even while every server keeps a
            # shared prefix cached locally; a pool hit recomputed because recomputing was
            # cheaper is not (saving it again would only read its blocks out to find their
            # keys taken: on a GPU, a copy to the host of every block for nothing).
            start_tokens = local_tokens + num_external if pool_tokens is None else pool_tokens
            start = [start_tokens // g.block_size for g in self.coordinator.groups]
            if state is None:
                state = self.requests[req_id] = RequestState()
            if state.saves is None:
                state.saves = self._saving[req_id] = SaveProgress(
                    request=request,
                    saved_upto=start,
                    trace_context=self.stats.trace_context(request),
                )
            elif state.load_failed:
                state.saves.rewind(start)
                self._saving[req_id] = state.saves
        if num_external == 0:
            return  # nothing external (or vLLM declined the hit): vLLM expects no load
        load = self._load_plan(request, block_ids_of(), num_external, plan)
        self._pending_loads.append(load)
        if state is None:
            state = self.requests[req_id] = RequestState()
        # Its request comes back to lookup after a failure: remember what it loads.
        state.loaded_blocks = {b for g in load.groups for b in g.block_ids}
        state.loading = True
        if load.refused:
            state.load_failed = True

    def _load_plan(
        self, request: Any, block_ids: Sequence[list[int]], num_external: int, plan: LoadPlan | None
    ) -> RequestLoad:
        """The load of exactly the ``num_external`` tokens vLLM allocated blocks for.

        Should vLLM's count and the lookup's plan ever differ (or the blocks not be where the
        plan expects them), nothing is loaded: the load is refused, the workers report it
        failed, and vLLM recomputes the request. A wrong plan never stops the engine.
        """
        req_id = request.request_id
        trace_context = self.stats.trace_context(request)
        problem = None
        coord = self.coordinator
        if plan is None or coord is None:
            problem = "no lookup planned it"
        elif num_external != plan.hit.hit_tokens - plan.local_tokens:
            problem = f"the lookup planned {plan.hit.hit_tokens - plan.local_tokens}"
        else:
            try:
                return RequestLoad(
                    req_id=req_id,
                    groups=[
                        _group_load(group, plan, block_ids[group.group_id], coord, request.block_hashes)
                        for group in coord.groups
                    ],
                    hit_tokens=plan.hit.hit_tokens,
                    trace_context=trace_context,
                )
            except (IndexError, KeyError):
                problem = "its blocks are not where the lookup planned them"
        logger.warning(
            "KVPoolConnector refused a load of %d tokens vLLM allocated (%s): the request recomputes",
            num_external,
            problem,
        )
        return RequestLoad(req_id=req_id, groups=[], hit_tokens=0, trace_context=trace_context, refused=True)

    # --- per step ---------------------------------------------------------------
    def build_connector_meta(
        self, scheduler_output: Any, block_ids_of: Callable[[str], Sequence[list[int]]]
    ) -> PoolConnectorMetadata:
        meta = PoolConnectorMetadata(
            loads=self._pending_loads,
            forward_tokens=scheduler_output.total_num_scheduled_tokens,
        )
        self._pending_loads = []
        self.rates.step_planned(
            meta.forward_tokens, len(getattr(scheduler_output, "num_scheduled_tokens", ()))
        )
        if self.can_save and self.coordinator is not None:
            offers = boundary_state_offers(scheduler_output)
            scheduled = scheduler_output.num_scheduled_tokens
            save_decode = self.save_decode_cache
            for req_id, tracked in list(self._saving.items()):
                num_new = scheduled.get(req_id, 0)
                if num_new <= 0:
                    continue
                request = tracked.request
                savable = request.num_tokens if save_decode else request.num_prompt_tokens
                if min(request.num_computed_tokens + num_new, savable) >= tracked.next_save_at:
                    offered = None if offers is None else offers.get(req_id, ())
                    save = self._plan_save(tracked, req_id, num_new, block_ids_of, offered)
                    if save is not None:
                        meta.saves.append(save)
                if not save_decode and request.num_prompt_tokens < tracked.next_save_at:
                    del self._saving[req_id]  # its prompt's blocks are all planned
        # The lookups vLLM asked for during this schedule() past its budget go to the master together.
        self.presence.flush()
        self._step_budget_left_s = self.lookup_budget_s
        if meta.forward_tokens == 0:
            # An idle step: the engine only waits. Let the presence thread answer the
            # lookups (it needs the GIL the engine's loop would hold), so the next step
            # admits the requests.
            self.presence.wait_idle(self.idle_step_wait_s, lookups_only=True)
        return meta

    def _plan_save(
        self,
        tracked: SaveProgress,
        req_id: str,
        num_new: int,
        block_ids_of: Callable[[str], Sequence[list[int]]],
        offered: Sequence[tuple[int, int, int]] | None = None,
    ) -> RequestSave | None:
        """The blocks of ``req_id`` this step completes, to save after its forward.

        A Mamba group's state blocks are the ones vLLM hands off this step
        (``offered``: ``(group, block id, boundary tokens)``), never read by position
        from the block table, where speculative blocks relocate and checkpoints move;
        None (no hand-off from this vLLM) falls back to the table.
        """
        coord = self.coordinator
        assert coord is not None
        request = tracked.request
        savable = request.num_tokens if self.save_decode_cache else request.num_prompt_tokens
        computed_after = min(request.num_computed_tokens + num_new, savable)
        block_sizes = self._block_sizes
        if computed_after < tracked.next_save_at:
            return None  # completes no block: nothing to plan (0: unknown, new or rewound)
        block_ids = block_ids_of(req_id)
        block_hashes = request.block_hashes
        groups: list[GroupTransfer] = []
        digest_of: dict[bytes, str] = {}  # groups of one block size share their hashes
        boundaries: dict[bool, Any] = {}  # replay boundaries, by use_eagle
        for group in coord.groups:
            gid = group.group_id
            if not group.prefix_cacheable:
                groups.append(GroupTransfer(group_id=gid))
                continue
            view = coord.group_block_hashes(gid, block_hashes)
            end = min(computed_after // group.block_size, len(view), len(block_ids[gid]))
            start = tracked.saved_upto[gid]
            transfer = GroupTransfer(group_id=gid)
            if end > start:
                below = retained_blocks(group.spec)
                mask = group.manager_cls.reachable_block_mask(
                    start,
                    end + below,
                    coord.alignment_tokens,
                    group.spec,
                    group.use_eagle,
                    # Dense: a future prompt may share any aligned prefix, not
                    # only this prompt's replay boundary.
                    retention_interval=None,
                    reachable_boundaries=_replay_boundaries(boundaries, request, coord, group.use_eagle),
                    dcp_world_size=group.dcp_world_size,
                    final_segment_end_block=cdiv(request.num_prompt_tokens, group.block_size),
                )
                if mask is not None and below:
                    mask = _reaching_below(mask, below, end - start)
                states = _boundary_states(group, offered)
                ids, digests, kept = block_ids[gid], transfer.digests, transfer.block_ids
                replace_below = tracked.replace_upto[gid] if tracked.replace_upto else 0
                for index in range(start, end):
                    block_id = ids[index] if states is None else states.get(index, 0)
                    if (mask is not None and not mask[index - start]) or block_id <= 0:
                        transfer.masked += 1
                        continue
                    block_hash = bytes(view[index])
                    digest = digest_of.get(block_hash)
                    if digest is None:
                        digest = digest_of[block_hash] = hash_digest(block_hash)
                    digests.append(digest)
                    kept.append(block_id)
                    if index < replace_below:
                        transfer.replacing += 1
                tracked.saved_upto[gid] = end
            groups.append(transfer)
        tracked.note_saved(block_sizes)
        if not any(len(g) for g in groups) and not any(g.masked for g in groups):
            return None
        return RequestSave(req_id=req_id, groups=groups, trace_context=tracked.trace_context)

    # --- completion ---------------------------------------------------------------
    def on_worker_output(
        self,
        finished_recving: set[str],
        failed_recving: set[str],
        invalid_blocks: set[int],
        block_ids_of: Callable[[str], Sequence[list[int]]] | None = None,
    ) -> int:
        """Note completed loads, and which requests a failed load sends back to recompute; the
        number of ``invalid_blocks`` not reported before (each rank reports its failed blocks
        when its own load ends: one block may come again, from another rank, a step later)."""
        requests = self.requests
        for req_id in failed_recving:
            if (state := requests.get(req_id)) is not None:
                state.load_failed = True
        newly_failed = 0
        if invalid_blocks:  # rare: no set is built in a step without failures
            new_invalid = set(invalid_blocks)
            for state in requests.values():
                if state.loaded_blocks and not state.loaded_blocks.isdisjoint(invalid_blocks):
                    state.load_failed = True
                    new_invalid -= state.failed_blocks
                    state.failed_blocks |= state.loaded_blocks & invalid_blocks
            if block_ids_of is not None:
                self._rewind_over_failed_blocks(invalid_blocks, block_ids_of)
            newly_failed = len(new_invalid)
        for req_id in finished_recving:
            if (state := requests.get(req_id)) is not None:
                state.loading = False
                state.loaded_blocks = None
                state.failed_blocks.clear()
        return newly_failed

    def on_step_output(self, worker_stats: Any) -> None:
        """The workers' connector stats of a step (None: none): learn the load rate from them."""
        data = worker_stats if isinstance(worker_stats, dict) else getattr(worker_stats, "data", None)
        if data:
            self.rates.observe_transfers(transfer_sample(data), self.transport)

    def on_step_done(self) -> None:
        """A step's output was processed: the step planned first and not yet done is, which
        times it. (vLLM asks for the scheduler's stats once per step output, idle steps
        included; ``update_connector_output`` comes only when the workers report something.)"""
        self.rates.step_reported()

    def take_decision_data(self) -> dict[str, Any] | None:
        """The load decisions since the last call, and the rates if they changed (a stats
        payload); None when there is nothing new."""
        rates = self.rates
        if not self._decisions and not rates.changed:
            return None
        used = rates.rates(self.transport)
        data = decision_data(
            self._decisions,
            self._skipped_tokens,
            {t: r.rate for t, r in rates.load.items()} if rates.changed else None,
            used.prefill_tokens_per_s if rates.changed and used.prefill_samples else None,
        )
        self._decisions, self._skipped_tokens, rates.changed = {}, 0, False
        return data

    def _rewind_over_failed_blocks(
        self, invalid_blocks: set[int], block_ids_of: Callable[[str], Sequence[list[int]]]
    ) -> None:
        """Save again what vLLM recomputes in place of blocks whose load failed.

        vLLM has already moved each affected request back (``num_computed_tokens``) to
        before its first failed block; its blocks from there on are recomputed and must be
        saved then, replacing anything the pool holds for them. Block ids name blocks across
        requests only in a single-group layout, the only one vLLM reports failed blocks for.
        """
        coord = self.coordinator
        if coord is None or len(coord.groups) != 1:
            return
        (group,) = coord.groups
        for req_id, state in self.requests.items():
            tracked = state.saves
            if tracked is None:
                continue
            try:
                (ids,) = block_ids_of(req_id)
            except (KeyError, ValueError):
                continue
            if invalid_blocks.isdisjoint(ids):
                continue
            tracked.rewind([tracked.request.num_computed_tokens // group.block_size])
            self._saving[req_id] = tracked

    def request_finished(self, req_id: str) -> bool:
        """Forget ``req_id``; True when an async load may still write its blocks.

        vLLM then frees them when the worker reports that load finished
        receiving (``finished_recving`` of a finished request frees its blocks).
        """
        self._saving.pop(req_id, None)
        state = self.requests.pop(req_id, None)
        if state is None:
            return False
        state.cancel_lookup()
        return state.loading


def boundary_state_offers(scheduler_output: Any) -> Mapping[str, Sequence[tuple[int, int, int]]] | None:
    """vLLM's Mamba boundary-state hand-offs of this step by request; None when it gives none."""
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    return getattr(state, "boundary_state_offloads", None)


def _boundary_states(group: Any, offered: Sequence[tuple[int, int, int]] | None) -> dict[int, int] | None:
    """A Mamba group's handed-off state blocks by block index; None: read the block table."""
    if offered is None or not isinstance(group.spec, MambaSpec):
        return None
    return {
        tokens // group.block_size - 1: block_id
        for group_id, block_id, tokens in offered
        if group_id == group.group_id and tokens > 0 and tokens % group.block_size == 0
    }


def _replay_boundaries(cache: dict[bool, Any], request: Any, coord: Any, use_eagle: bool) -> Any:
    """vLLM's replay boundaries of ``request``'s prompt, computed once per ``use_eagle``."""
    if use_eagle not in cache:
        cache[use_eagle] = replay_boundaries(request.num_prompt_tokens, coord.scheduler_block_size, use_eagle)
    return cache[use_eagle]


def _group_load(
    group: Any, plan: LoadPlan, block_ids: Sequence[int], coord: HybridHitCoordinator, block_hashes: Any
) -> GroupTransfer:
    """One group's part of a load: the blocks its mask needs past the local hit, and how
    many the hit covers without moving them.

    An attention group loads every real block vLLM allocated for the hit, not only those its
    hit needed: with multi-module MTP vLLM keeps ``extra_retained_tokens`` below a sliding
    window, allocates real blocks for them and caches them once the load is reported, so a
    block left unloaded there would be a cached block of garbage. (A Mamba group loads its
    last state only: the other blocks vLLM allocates it are never read as KV.)
    """
    gid = group.group_id
    transfer = GroupTransfer(group_id=gid)
    first_block = plan.local_tokens // group.block_size
    covered = cdiv(plan.hit.hit_tokens, group.block_size)
    wanted = [index for index in plan.hit.needed_blocks[gid] if index >= first_block]
    if not isinstance(group.spec, MambaSpec):
        needed = set(wanted)
        retained = [i for i in range(first_block, covered) if block_ids[i] > 0 and i not in needed]
        wanted = sorted(needed.union(retained))
    view = None
    for index in wanted:
        digest = plan.digests[gid].get(index)
        if digest is None:  # retained below the window: never asked about; its load says
            view = view if view is not None else coord.group_block_hashes(gid, block_hashes)
            digest = hash_digest(bytes(view[index]))
        transfer.digests.append(digest)
        transfer.block_ids.append(block_ids[index])
    transfer.masked = max(0, covered - first_block) - len(transfer.block_ids)
    return transfer


def retained_blocks(spec: Any) -> int:
    """Blocks a hit on a sliding-window group loads below its window: with multi-module MTP,
    vLLM keeps ``extra_retained_tokens`` there and allocates real blocks for them (0 else)."""
    extra = getattr(spec, "extra_retained_tokens", 0)
    if not isinstance(spec, SlidingWindowSpec) or extra <= 0:
        return 0
    window = spec.sliding_window - 1
    return cdiv(window + extra, spec.block_size) - cdiv(window, spec.block_size)


def _reaching_below(mask: Sequence[bool], below: int, count: int) -> list[bool]:
    """The first ``count`` entries of ``mask``, each also kept when one of the ``below``
    blocks after it is: a hit ending there loads that many blocks more."""
    return [any(mask[index : index + below + 1]) for index in range(count)]


def hit_unit(coord: HybridHitCoordinator) -> int:
    """What every hit is a multiple of: the finest block any group hashes. A hit never covers a
    prompt's last token either, so none reaches past ``(num_tokens - 1) // unit * unit``."""
    return min([coord.hash_block_size, *(g.block_size for g in coord.groups)])

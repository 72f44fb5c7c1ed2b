"""The external hybrid (HMA) cache-hit coordinator.

Given which ``(group, block hash)`` pairs the pool holds, find the longest
prefix every KV-cache group can serve, exactly as vLLM's
``HybridKVCacheCoordinator`` would over its own block pool: vLLM's per-spec
managers (``find_longest_cache_hit``) run over a duck-typed block pool backed
by the presence set, iterated to the same fixed point. The result also says,
per group, which blocks the hit actually needs (its load mask): every block for
full attention, the window for sliding window, the last state for Mamba.

Hits are aligned to the scheduler block (fine-grained partial hash hits are off:
the pool moves whole blocks).
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import KVCacheBlock, eagle_proof_margin, resolve_block_hashes
from vllm.v1.core.single_type_kv_cache_manager import MambaManager, SingleTypeKVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MambaSpec


@dataclass(frozen=True)
class GroupLookup:
    """How one KV-cache group takes part in lookups."""

    group_id: int
    spec: KVCacheSpec
    manager_cls: type[SingleTypeKVCacheManager]
    block_size: int  # the manager's effective block size (DCP-scaled)
    dcp_world_size: int
    pcp_world_size: int
    use_eagle: bool
    prefix_cacheable: bool


@dataclass(frozen=True)
class SpecGroup:
    """Groups sharing one spec and manager: looked up together, as vLLM does."""

    spec: KVCacheSpec
    group_ids: tuple[int, ...]
    manager_cls: type[SingleTypeKVCacheManager]
    use_eagle: bool


@dataclass(frozen=True)
class HybridHit:
    """The reconciled hit and what each group needs from the pool for it."""

    hit_tokens: int
    # Per group: indices of the blocks (at the group's block size) the hit needs.
    needed_blocks: tuple[tuple[int, ...], ...]
    # Computes group_hit_tokens, a statistic: only when it is read.
    group_hits: Callable[[], tuple[int, ...]] = field(repr=False, compare=False)

    @cached_property
    def group_hit_tokens(self) -> tuple[int, ...]:
        """Per group: the hit that group alone could serve (before the hybrid intersection)."""
        return self.group_hits()

    def blocks_past(self, local_tokens: int, block_sizes: Sequence[int]) -> tuple[int, ...]:
        """Per group: its needed blocks past ``local_tokens`` (vLLM's own hit), those a load of
        this hit moves (``block_sizes``: each group's)."""
        return tuple(
            blocks_from(blocks, local_tokens // size) for blocks, size in zip(self.needed_blocks, block_sizes)
        )


def blocks_from(indices: Sequence[int], first: int) -> int:
    """How many of the ascending block ``indices`` are ``first`` or later."""
    return len(indices) - bisect_left(indices, first)


_NONE: Mapping[bytes, int] = {}


class _Markers:
    """Shared, read-only "cached block" markers: the one for index ``i`` has ``block_id`` ``i``.

    vLLM's managers only read the blocks a lookup hands them, so one marker per index
    serves every lookup on every thread; building one per block read cost ~0.5 µs each.
    """

    def __init__(self) -> None:
        self._table: list[KVCacheBlock] = []
        self._grow = threading.Lock()

    def upto(self, count: int) -> list[KVCacheBlock]:
        """A table holding at least ``count`` markers (never shrinks; grown under a lock)."""
        table = self._table
        if len(table) < count:
            with self._grow:
                table = self._table
                if len(table) < count:
                    size = max(count, 2 * len(table), 1024)
                    table = table + [KVCacheBlock(block_id=i) for i in range(len(table), size)]
                    self._table = table
        return table


_MARKERS = _Markers()

#: Rounds of questions before a lookup asks about every block left.
MAX_ASK_ROUNDS = 3

#: Lookup shapes whose first questions a coordinator remembers before it starts over.
FIRST_QUESTIONS_KEPT = 4096

#: A hit, and per group what was asked about (block index -> held).
Found = tuple["HybridHit", dict[int, dict[int, bool]]]

#: A lookup's rounds: it yields questions (group -> block indices), is sent their answers
#: (group -> held, per index; None: the pool could not tell) and returns what it found.
Rounds = Generator[dict[int, list[int]], Mapping[int, Sequence[bool]] | None, Found]

#: Per group, the indices of blocks to ask about -> per group, whether the pool holds
#: each (None: the pool could not tell).
Ask = Callable[[Mapping[int, Sequence[int]]], Mapping[int, Sequence[bool]] | None]


class AskingBlockPool:
    """Duck-typed ``BlockPool`` over what the pool was asked so far (group -> index -> held).

    A block of the lookup not asked about yet is taken as present when
    ``assume_present`` (and noted in ``read_unknown``), else as absent.
    """

    def __init__(
        self,
        hash_block_size: int,
        index_of: Mapping[int, Mapping[bytes, int]],
        known: Mapping[int, Mapping[int, bool]],
        *,
        assume_present: bool,
    ):
        self.hash_block_size = hash_block_size
        self.null_block = KVCacheBlock(block_id=-1, is_null=True)
        self._index_of = index_of
        self._known = known
        self._assume_present = assume_present
        self.read_unknown: dict[int, dict[int, None]] = {}  # group -> indices, in order read
        self._markers = _MARKERS.upto(max((len(m) for m in index_of.values()), default=0))

    def get_cached_block(
        self, block_hash: Any, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        key = block_hash if type(block_hash) is bytes else bytes(block_hash)
        blocks: list[KVCacheBlock] = []
        for group_id in kv_cache_group_ids:
            index = self._index_of.get(group_id, _NONE).get(key)
            if index is None:
                return None  # past what the lookup may use
            held = self._known[group_id].get(index)
            if held is None:
                if not self._assume_present:
                    return None
                self.read_unknown.setdefault(group_id, {})[index] = None
            elif not held:
                return None
            if index >= len(self._markers):  # an index map that is not 0..n-1 (the oracle's)
                self._markers = _MARKERS.upto(index + 1)
            blocks.append(self._markers[index])
        return blocks


def block_indices(wanted: Mapping[int, Sequence[bytes]]) -> dict[int, dict[bytes, int]]:
    """Per group, each of ``wanted``'s hashes -> its index (groups sharing one list share it)."""
    index_of: dict[int, dict[bytes, int]] = {}
    by_list: dict[int, dict[bytes, int]] = {}
    for group_id, hashes in wanted.items():
        shared = by_list.get(id(hashes))
        if shared is None:
            shared = by_list[id(hashes)] = {h: i for i, h in enumerate(hashes)}
        index_of[group_id] = shared
    return index_of


def _asks(questions: Mapping[int, Sequence[int]]) -> bool:
    """Whether ``questions`` name any block (a round that names none needs no answer)."""
    return any(questions.values())


#: The answer to a round that names no block.
_NOTHING_ASKED: Mapping[int, Sequence[bool]] = {}


def _note(
    questions: Mapping[int, Sequence[int]],
    answers: Mapping[int, Sequence[bool]] | None,
    known: dict[int, dict[int, bool]],
) -> bool:
    """Note the ``answers`` to ``questions`` in ``known``; False when the pool could not tell."""
    if answers is None:
        return False
    for group_id, indices in questions.items():
        held = known[group_id]
        for index, ok in zip(indices, answers.get(group_id, ()), strict=True):
            held[index] = ok
    return True


class HybridHitCoordinator:
    """vLLM's hybrid fixed point over pool presence instead of the GPU block pool."""

    def __init__(
        self,
        groups: Sequence[GroupLookup],
        scheduler_block_size: int,
        hash_block_size: int,
    ):
        self.groups = tuple(groups)
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.alignment_tokens = scheduler_block_size
        self.spec_groups = self._split(self.groups)
        # vLLM's hybrid coordinator looks past the candidate before dropping an EAGLE
        # block; with one group its unitary coordinator does not.
        self._eagle_margin = len(self.groups) > 1
        self._full_attention_groups = tuple(
            g for sg in self.spec_groups if isinstance(sg.spec, FullAttentionSpec) for g in sg.group_ids
        )
        # Each lookup shape's first questions but full attention's (see _first_questions);
        # any thread may add one.
        self._first_by_shape: dict[tuple[int, int, tuple[int, ...]], dict[int, tuple[int, ...]]] = {}

    @classmethod
    def from_vllm_coordinator(cls, coordinator: Any) -> HybridHitCoordinator:
        """Mirror the configuration of vLLM's live ``KVCacheCoordinator``."""
        groups = []
        eagle_ids = set(getattr(coordinator, "eagle_group_ids", ()))
        for group_id, (manager, group) in enumerate(
            zip(coordinator.single_type_managers, coordinator.kv_cache_config.kv_cache_groups)
        ):
            groups.append(
                GroupLookup(
                    group_id=group_id,
                    spec=group.kv_cache_spec,
                    manager_cls=type(manager),
                    block_size=manager.block_size,
                    dcp_world_size=manager.dcp_world_size,
                    pcp_world_size=manager.pcp_world_size,
                    use_eagle=group_id in eagle_ids,
                    prefix_cacheable=group.kv_cache_spec.prefix_cacheable,
                )
            )
        return cls(groups, coordinator.scheduler_block_size, coordinator.block_pool.hash_block_size)

    @staticmethod
    def _split(groups: Sequence[GroupLookup]) -> tuple[SpecGroup, ...]:
        spec_groups: list[SpecGroup] = []
        for g in groups:
            if not g.prefix_cacheable:
                continue
            for i, sg in enumerate(spec_groups):
                if sg.spec == g.spec and sg.manager_cls is g.manager_cls:
                    spec_groups[i] = SpecGroup(
                        sg.spec, (*sg.group_ids, g.group_id), sg.manager_cls, sg.use_eagle or g.use_eagle
                    )
                    break
            else:
                spec_groups.append(SpecGroup(g.spec, (g.group_id,), g.manager_cls, g.use_eagle))
        # Full attention first: its left-to-right scan gives the tightest first bound.
        spec_groups.sort(key=lambda sg: not isinstance(sg.spec, FullAttentionSpec))
        return tuple(spec_groups)

    # --- keys --------------------------------------------------------------
    def group_block_hashes(self, group_id: int, block_hashes: Sequence[Any]) -> Sequence[Any]:
        """The request's block hashes viewed at ``group_id``'s block size."""
        # vLLM types the hashes as its list or its block-size view; both index like a sequence.
        return resolve_block_hashes(  # type: ignore[return-value]
            block_hashes,  # type: ignore[arg-type]
            self.hash_block_size,
            self.groups[group_id].block_size,
        )

    def lookup_blocks(self, block_hashes: Sequence[Any], max_hit_tokens: int) -> dict[int, list[bytes]]:
        """Per cacheable group, the hashes of blocks a hit up to ``max_hit_tokens`` may use.

        Groups of one block size (and reach) share one list.
        """
        wanted: dict[int, list[bytes]] = {}
        views: dict[tuple[int, int], list[bytes]] = {}
        for sg in self.spec_groups:
            for group_id in sg.group_ids:
                block_size = self.groups[group_id].block_size
                view = self.group_block_hashes(group_id, block_hashes)
                # EAGLE groups look one block past the candidate before dropping it.
                limit = max_hit_tokens // block_size + (1 if sg.use_eagle else 0)
                count = min(limit, len(view))
                hashes = views.get((block_size, count))
                if hashes is None:
                    if isinstance(view, list) and all(type(h) is bytes for h in view[:1]):
                        hashes = view[:count]
                    else:
                        hashes = [bytes(view[i]) for i in range(count)]
                    views[(block_size, count)] = hashes
                wanted[group_id] = hashes
        return wanted

    # --- the fixed point ---------------------------------------------------
    def find_hit_asking(
        self,
        block_hashes: Sequence[Any],
        wanted: Mapping[int, Sequence[bytes]],
        max_hit_tokens: int,
        ask: Ask,
        max_rounds: int = MAX_ASK_ROUNDS,
        ask_ahead_blocks: int = 0,
    ) -> Found:
        """:meth:`hit_rounds`, each round's questions answered by ``ask`` at once."""
        rounds = self.hit_rounds(block_hashes, wanted, max_hit_tokens, max_rounds, ask_ahead_blocks)
        try:
            questions = next(rounds)
            while True:
                questions = rounds.send(ask(questions))
        except StopIteration as done:
            return done.value

    def hit_rounds(
        self,
        block_hashes: Sequence[Any],
        wanted: Mapping[int, Sequence[bytes]],
        max_hit_tokens: int,
        max_rounds: int = MAX_ASK_ROUNDS,
        ask_ahead_blocks: int = 0,
        index_of: Mapping[int, Mapping[bytes, int]] | None = None,
    ) -> Rounds:
        """The hit over the pool's presence, asking only about the blocks the fixed point reads.

        A generator of rounds: it yields, per group, the indices of blocks to ask about,
        and is sent, per group, whether the pool holds each (None when it cannot tell:
        then the lookup is a miss); it returns the hit. A caller answering many lookups
        at once (:mod:`~kvpool.connector.scheduler.lookups`) keeps each one's generator
        between rounds, so no round's work is done twice. ``wanted`` is
        :meth:`lookup_blocks`' answer (``index_of``: :func:`block_indices` of it, if
        already built). The first round asks what any hit reads first
        (:meth:`_first_questions`); each later one runs the fixed point taking every
        block not yet asked about as present, asks about the ones it read, and is done
        when it read none or they all were present; after ``max_rounds`` rounds it asks
        about every block left. The hit is the one :meth:`hit_over` finds over the pool's
        whole presence (``testing.hit_oracle``): the fixed point's result depends only on
        what it read, and everything it read was answered by the pool. When every block
        of ``wanted`` is at most ``ask_ahead_blocks`` more than the first round asks, the
        first round asks about every one: any hit is then found in that one round (a
        shorter hit's later questions are among them). Returns the hit and, per group,
        what was asked (index -> held); the per-group hits take a block never asked about
        as absent.
        """
        known: dict[int, dict[int, bool]] = {g: {} for g in wanted}
        if index_of is None:
            index_of = block_indices(wanted)
        first = self._first_questions(block_hashes, index_of, wanted, max_hit_tokens)
        if ask_ahead_blocks > 0:
            every = sum(len(hashes) for hashes in wanted.values())
            if every - sum(len(indices) for indices in first.values()) <= ask_ahead_blocks:
                first = {g: list(range(len(hashes))) for g, hashes in wanted.items()}
        if not _note(first, (yield first) if _asks(first) else _NOTHING_ASKED, known):
            return self._miss(), known
        if self._nothing_held(known, wanted):  # full attention lacks its first block: a hit of 0
            alone_pool = AskingBlockPool(self.hash_block_size, index_of, known, assume_present=False)
            return HybridHit(
                0,
                tuple(() for _ in self.groups),
                lambda: self._alone(block_hashes, alone_pool, max_hit_tokens),
            ), known
        rounds = 1
        while True:
            pool = AskingBlockPool(self.hash_block_size, index_of, known, assume_present=True)
            hit = self.hit_over(
                block_hashes,
                pool,
                max_hit_tokens,
                AskingBlockPool(self.hash_block_size, index_of, known, assume_present=False),
            )
            if not pool.read_unknown:
                return hit, known
            rounds += 1
            questions = {g: list(indices) for g, indices in pool.read_unknown.items()}
            if rounds >= max_rounds:
                questions = {
                    g: [i for i in range(len(hashes)) if i not in known[g]] for g, hashes in wanted.items()
                }
            if not _note(questions, (yield questions) if _asks(questions) else _NOTHING_ASKED, known):
                return self._miss(), known
            if all(known[g][i] for g, indices in pool.read_unknown.items() for i in indices):
                return hit, known  # what it took as present, the pool holds: the hit stands

    def _nothing_held(
        self, known: Mapping[int, Mapping[int, bool]], wanted: Mapping[int, Sequence[bytes]]
    ) -> bool:
        """Whether a full-attention group is known to lack its first block: every hit is then 0."""
        for sg in self.spec_groups:
            if isinstance(sg.spec, FullAttentionSpec):
                for g in sg.group_ids:
                    if wanted[g] and known[g].get(0) is False:
                        return True
        return False

    def _first_questions(
        self,
        block_hashes: Sequence[Any],
        index_of: Mapping[int, Mapping[bytes, int]],
        wanted: Mapping[int, Sequence[bytes]],
        max_hit_tokens: int,
    ) -> dict[int, list[int]]:
        """What any hit reads first: full attention's whole prefix, and each other group's
        blocks at the longest hit's end (as its manager reads them from there).

        With nothing known and every block taken as present, which blocks the managers read
        depends only on how many each group may use and the longest hit (block hashes
        within a request differ: each one chains its parent's): remembered by that shape,
        so a request of a length seen before skips the managers. Only what is asked first
        depends on it; the later rounds ask whatever the fixed point reads unanswered.
        """
        shape = (max_hit_tokens, len(block_hashes), tuple(len(wanted[g]) for g in sorted(wanted)))
        remembered = self._first_by_shape.get(shape)
        if remembered is None:  # the other groups' few blocks (full attention's are all of them)
            pool = AskingBlockPool(
                self.hash_block_size, index_of, {g: {} for g in wanted}, assume_present=True
            )
            for sg in self.spec_groups:
                if not isinstance(sg.spec, FullAttentionSpec):
                    self._manager_hit(sg, block_hashes, max_hit_tokens, pool, sg.use_eagle)
            remembered = {g: tuple(indices) for g, indices in pool.read_unknown.items()}
            if len(self._first_by_shape) >= FIRST_QUESTIONS_KEPT:
                self._first_by_shape.clear()  # prompt lengths vary without bound: start over
            self._first_by_shape[shape] = remembered
        questions = {g: list(range(len(wanted[g]))) for g in self._full_attention_groups if g in wanted}
        questions.update((g, list(indices)) for g, indices in remembered.items())
        return questions

    def _miss(self) -> HybridHit:
        return HybridHit(0, tuple(() for _ in self.groups), lambda: tuple(0 for _ in self.groups))

    def group_hits(
        self,
        block_hashes: Sequence[Any],
        wanted: Mapping[int, Sequence[bytes]],
        known: Mapping[int, Mapping[int, bool]],
        max_hit_tokens: int,
        index_of: Mapping[int, Mapping[bytes, int]] | None = None,
    ) -> tuple[int, ...]:
        """Each group's own hit over ``known`` (group -> index -> held; others absent);
        ``index_of``: :func:`block_indices` of ``wanted``, if already built."""
        if not any(True in held.values() for held in known.values()):
            return tuple(0 for _ in self.groups)  # the pool holds none of the blocks
        if index_of is None:
            index_of = block_indices(wanted)
        pool = AskingBlockPool(self.hash_block_size, index_of, known, assume_present=False)
        return self._alone(block_hashes, pool, max_hit_tokens)

    def hit_over(
        self,
        block_hashes: Sequence[Any],
        pool: Any,
        max_hit_tokens: int,
        alone_pool: Any,
    ) -> HybridHit:
        """vLLM's fixed point over ``pool`` (any duck-typed ``BlockPool``: ``get_cached_block``,
        ``null_block``, ``hash_block_size``); per-group hits (when read) over ``alone_pool``."""
        num_groups = len(self.groups)
        blocks_by_group: list[list[KVCacheBlock] | None] = [None] * num_groups
        length_by_group = [0] * num_groups
        hit_length = max_hit_tokens
        is_simple_hybrid = len(self.spec_groups) == 2 and isinstance(
            self.spec_groups[0].spec, FullAttentionSpec
        )
        eagle_verified: set[int] = set()
        while True:
            curr = hit_length
            for idx, sg in enumerate(self.spec_groups):
                first = self.groups[sg.group_ids[0]]
                cached = blocks_by_group[first.group_id]
                if isinstance(sg.spec, FullAttentionSpec) and cached is not None:
                    curr = min(curr, length_by_group[first.group_id])
                    continue
                drop_eagle = sg.use_eagle and idx not in eagle_verified
                max_length = curr
                if drop_eagle and self._eagle_margin and not isinstance(sg.spec, MambaSpec):
                    margin = eagle_proof_margin(first.block_size, self.hash_block_size, False)
                    max_length = min(curr + margin, len(block_hashes) * self.hash_block_size)
                hit_blocks, new_length = self._manager_hit(sg, block_hashes, max_length, pool, drop_eagle)
                if drop_eagle:
                    eagle_verified.add(idx)
                elif new_length < curr:
                    eagle_verified.clear()
                curr = new_length
                for group_id, blocks in zip(sg.group_ids, hit_blocks):
                    blocks_by_group[group_id] = blocks
                    length_by_group[group_id] = new_length
            if curr >= hit_length:
                break
            hit_length = curr
            if is_simple_hybrid:
                break
        return HybridHit(
            hit_tokens=hit_length,
            needed_blocks=tuple(
                self._needed(self.groups[g], blocks_by_group[g], hit_length) for g in range(num_groups)
            ),
            group_hits=lambda: self._alone(block_hashes, alone_pool, max_hit_tokens),
        )

    def _manager_hit(
        self, sg: SpecGroup, block_hashes: Sequence[Any], max_length: int, pool: Any, drop_eagle: bool
    ) -> tuple[Any, int]:
        """vLLM's own manager of ``sg``'s spec, asked for its longest hit in ``pool``."""
        first = self.groups[sg.group_ids[0]]
        return sg.manager_cls.find_longest_cache_hit(
            block_hashes=block_hashes,  # type: ignore[arg-type]  # vLLM's list or its view
            max_length=max_length,
            kv_cache_group_ids=list(sg.group_ids),
            block_pool=pool,
            kv_cache_spec=sg.spec,
            drop_eagle_block=drop_eagle,
            alignment_tokens=self.alignment_tokens,
            dcp_world_size=first.dcp_world_size,
            pcp_world_size=first.pcp_world_size,
        )

    def _alone(self, block_hashes: Sequence[Any], pool: Any, max_hit_tokens: int) -> tuple[int, ...]:
        """Each group's own hit, as vLLM's ``find_longest_cache_hit_per_group`` sees it."""
        alone = [0] * len(self.groups)
        for sg in self.spec_groups:
            first = self.groups[sg.group_ids[0]]
            max_length = max_hit_tokens
            if sg.use_eagle and self._eagle_margin and not isinstance(sg.spec, MambaSpec):
                margin = eagle_proof_margin(first.block_size, self.hash_block_size, False)
                max_length = min(max_hit_tokens + margin, len(block_hashes) * self.hash_block_size)
            _, length = self._manager_hit(sg, block_hashes, max_length, pool, sg.use_eagle)
            for group_id in sg.group_ids:
                alone[group_id] = length
        return tuple(alone)

    @staticmethod
    def _needed(group: GroupLookup, blocks: list[KVCacheBlock] | None, hit_length: int) -> tuple[int, ...]:
        """Indices of real (non-null) hit blocks inside the reconciled hit."""
        if not blocks or hit_length == 0:
            return ()
        limit = cdiv(hit_length, group.block_size)
        if isinstance(group.spec, MambaSpec) or group.manager_cls is MambaManager:
            # Only the state at the hit boundary is needed.
            last = hit_length // group.block_size - 1
            return (last,) if last < len(blocks) and not blocks[last].is_null else ()
        return tuple(b.block_id for b in blocks[:limit] if not b.is_null)

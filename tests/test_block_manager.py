"""BlockManager: refcounts, the null block, prefix caching by chained full-block hashes, LRU eviction."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxllm.engine.block_manager import NULL_BLOCK, BlockManager
from jaxllm.engine.sequence import Sequence


def make_seq(tokens, seq_id="s", **kw) -> Sequence:
    return Sequence(seq_id, list(tokens), arrival_time=0.0, **kw)


def compute(bm: BlockManager, seq: Sequence, num_new: int | None = None) -> None:
    """What the scheduler does for a chunk: pages, then num_computed_tokens, then commit."""
    num_new = seq.num_tokens - seq.num_computed_tokens if num_new is None else num_new
    assert bm.ensure_slots(seq, num_new)
    seq.num_computed_tokens += num_new
    bm.commit_full_blocks(seq)


def admit(bm: BlockManager, seq: Sequence) -> int:
    num_cached = bm.allocate_prompt(seq)
    assert num_cached is not None
    seq.num_computed_tokens = seq.num_tokens  # allocate_prompt covered every token
    bm.commit_full_blocks(seq)
    return num_cached


def test_null_block_is_never_allocated():
    bm = BlockManager(num_blocks=5, block_size=2)
    assert bm.num_usable_blocks == bm.num_free_blocks == 4
    seq = make_seq(range(8))
    assert admit(bm, seq) == 0
    assert sorted(seq.block_table) == [1, 2, 3, 4] and NULL_BLOCK not in seq.block_table
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    assert bm.allocate_prompt(make_seq([9], "t")) is None
    bm.free(seq)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    bm.check_invariants([])


def test_ensure_slots_grows_to_cover_computed_plus_new():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    seq = make_seq(range(3))
    assert bm.allocate_prompt(seq, num_new_tokens=3) == 0
    assert len(seq.block_table) == 1
    seq.num_computed_tokens = 3
    assert bm.can_append(seq, 1) and bm.ensure_slots(seq, 1) and len(seq.block_table) == 1
    assert bm.ensure_slots(seq, 2) and len(seq.block_table) == 2  # positions 3, 4
    assert not bm.can_append(seq, 10) and not bm.ensure_slots(seq, 10)  # 13 tokens: 4 blocks, 1 free
    assert len(seq.block_table) == 2  # unchanged on failure
    assert bm.ensure_slots(seq, 9) and len(seq.block_table) == 3
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 3


def test_prefix_hit_reuses_full_blocks_and_counts_tokens():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = make_seq(prompt, "a")
    assert admit(bm, a) == 0
    b = make_seq(prompt + [77], "b")
    assert admit(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.ref_counts[a.block_table[0]] == 2
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 11, 8)
    bm.check_invariants([a.block_table, b.block_table])


def test_whole_prompt_hit_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(8))  # exactly 2 blocks
    a = make_seq(prompt, "a")
    admit(bm, a)
    bm.free(a)
    b = make_seq(prompt, "b")
    # Rounded down to a block boundary below num_tokens - 1 = 7: one block.
    assert bm.allocate_prompt(b) == 4 and b.num_computed_tokens == 4 and len(b.block_table) == 2
    c = make_seq(prompt + [8], "c")
    assert bm.allocate_prompt(c) == 8


def test_hits_need_an_identical_prefix_from_position_zero():
    bm = BlockManager(num_blocks=16, block_size=2)
    admit(bm, make_seq([1, 2, 3, 4, 5], "a"))
    assert bm.find_cached_prefix(make_seq([9, 2, 3, 4, 5], "b")) == []  # same 2nd block, other 1st block
    assert len(bm.find_cached_prefix(make_seq([1, 2, 3, 9, 5], "c"))) == 1
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5], "d", cache_salt="x")) == []
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5], "e", skip_prefix_cache_read=True)) == []
    off = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=False)
    admit(off, make_seq([1, 2, 3, 4, 5], "a"))
    assert off.find_cached_prefix(make_seq([1, 2, 3, 4, 5], "b")) == [] and not off.hash_to_block


def test_only_known_computed_full_blocks_are_committed():
    bm = BlockManager(num_blocks=16, block_size=4)
    seq = make_seq(range(6))
    assert bm.allocate_prompt(seq, num_new_tokens=5) == 0
    seq.num_computed_tokens = 3
    bm.commit_full_blocks(seq)
    assert not bm.hash_to_block  # block 0 is not computed yet
    seq.num_computed_tokens = 5
    bm.commit_full_blocks(seq)
    assert len(bm.hash_to_block) == 1
    # A pending token (sampled on the device, id unknown) has KV computed but cannot be hashed.
    seq.num_computed_tokens = 6
    seq.num_pending = 2
    assert bm.ensure_slots(seq, 2)
    seq.num_computed_tokens = 8
    bm.commit_full_blocks(seq)
    assert len(bm.hash_to_block) == 1
    seq.output_token_ids += [6, 7]
    seq.num_pending = 0
    bm.commit_full_blocks(seq)
    assert len(bm.hash_to_block) == 2 and seq.num_committed_blocks == 2


def test_freed_cached_blocks_survive_until_needed_then_lru():
    bm = BlockManager(num_blocks=7, block_size=2)  # 6 usable
    a = make_seq([1, 2, 3, 4, 5], "a")  # blocks [1,2] [3,4] [5]
    admit(bm, a)
    a_full = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_cached_free_blocks == 2
    b = make_seq([7, 8, 9, 10, 11, 12, 13], "b")  # 4 blocks: the 4 uncached pages go first
    admit(bm, b)
    assert not set(b.block_table) & set(a_full) and bm.num_cached_free_blocks == 2
    c = make_seq([20, 21], "c")  # evicts a's tail block first (its blocks were freed last one first)
    admit(bm, c)
    assert c.block_table == [a_full[1]] and bm.num_cached_free_blocks == 1
    assert len(bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5], "d"))) == 1  # [1,2] still cached
    bm.free(c)
    bm.free(b)
    d = make_seq([1, 2, 3, 4, 5], "d")
    assert admit(bm, d) == 2 and d.block_table[0] == a_full[0]
    bm.check_invariants([d.block_table])


def test_revived_cached_blocks_count_against_capacity():
    bm = BlockManager(num_blocks=4, block_size=2)  # 3 usable
    a = make_seq([1, 2, 3, 4, 5], "a")
    admit(bm, a)
    bm.free(a)  # 2 cached-free + 1 plain
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "b")  # hits 2 blocks, needs 3 more: 5 > 3 free
    before = (list(bm.ref_counts), bm.num_free_blocks, bm.prefix_cache_queries)
    assert bm.allocate_prompt(b) is None
    assert (list(bm.ref_counts), bm.num_free_blocks, bm.prefix_cache_queries) == before and b.block_table == []
    assert bm.allocate_prompt(b, num_new_tokens=1) == 4 and len(b.block_table) == 3
    bm.check_invariants([b.block_table])


def test_concurrent_identical_prefixes_register_once():
    bm = BlockManager(num_blocks=16, block_size=2)
    a, b = make_seq([1, 2, 3], "a"), make_seq([1, 2, 3], "b")
    assert bm.allocate_prompt(a) == 0 and bm.allocate_prompt(b) == 0  # neither is committed yet
    for s in (a, b):
        s.num_computed_tokens = 3
        bm.commit_full_blocks(s)
    assert bm.hash_to_block == {bm.block_hash[a.block_table[0]]: a.block_table[0]}
    assert bm.block_hash[b.block_table[0]] is None
    bm.free(b)
    bm.free(a)
    assert bm.num_cached_free_blocks == 1
    bm.check_invariants([])


def test_double_free_raises_and_reset_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_seq([1, 2, 3], "a")
    admit(bm, a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(a)
    bm = BlockManager(num_blocks=8, block_size=2)
    admit(bm, a := make_seq([1, 2, 3], "a"))
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_free_blocks == 0 and not bm.hash_to_block and bm.num_free_blocks == 7
    bm.check_invariants([])


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit / grow / append / free against a shadow copy of what each page holds."""

    @initialize(
        num_blocks=st.integers(2, 9),
        block_size=st.integers(1, 4),
        caching=st.booleans(),
    )
    def setup(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.live: dict[str, Sequence] = {}
        self.counter = 0
        # page -> the token prefix (positions 0 .. end of this page) whose KV it holds, for full pages
        self.content: dict[int, tuple[int, ...]] = {}

    def _record_writes(self, seq: Sequence, start: int, end: int) -> None:
        bs = self.bm.block_size
        tokens = seq.all_token_ids
        for i in range(start // bs, -(-end // bs)):
            block = seq.block_table[i]
            if (i + 1) * bs <= end and (i + 1) * bs <= len(tokens):
                assert self.bm.ref_counts[block] == 1, "writing a shared page"
                self.content[block] = tuple(tokens[: (i + 1) * bs])
            else:
                self.content.pop(block, None)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=12), chunk=st.integers(1, 12))
    def admit(self, tokens, chunk):
        seq = make_seq(tokens, f"s{self.counter}")
        self.counter += 1
        cached = self.bm.find_cached_prefix(seq)
        bs = self.bm.block_size
        for i, block in enumerate(cached):
            assert self.content[block] == tuple(tokens[: (i + 1) * bs]), "prefix hit on different tokens"
        num_new = min(chunk, seq.num_tokens - len(cached) * bs)
        hits = self.bm.allocate_prompt(seq, num_new, cached)
        if hits is None:
            return
        assert hits == len(cached) * bs < seq.num_tokens
        seq.num_computed_tokens += num_new
        self._record_writes(seq, hits, seq.num_computed_tokens)
        self.bm.commit_full_blocks(seq)
        self.live[seq.seq_id] = seq

    @precondition(lambda self: self.live)
    @rule(data=st.data(), num_new=st.integers(1, 6), new_token=st.integers(0, 2))
    def grow(self, data, num_new, new_token):
        seq = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(new_token)  # a decode: the sampled token joins the sequence
        num_new = min(num_new, seq.num_tokens - seq.num_computed_tokens)
        start = seq.num_computed_tokens
        if not self.bm.ensure_slots(seq, num_new):
            return
        seq.num_computed_tokens += num_new
        self._record_writes(seq, start, seq.num_computed_tokens)
        self.bm.commit_full_blocks(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.bm.free(seq)

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants([s.block_table for s in self.live.values()])
        bs = self.bm.block_size
        for s in self.live.values():
            assert len(s.block_table) * bs >= s.num_computed_tokens
            assert NULL_BLOCK not in s.block_table
        for block in self.bm.hash_to_block.values():
            assert block in self.content

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.live.values():
            self.bm.free(seq)
        self.bm.check_invariants([])
        assert self.bm.num_free_blocks == self.bm.num_usable_blocks
        assert all(rc == 0 for rc in self.bm.ref_counts)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)

"""Paged KV block manager: refcounted fixed-size blocks and a prefix cache of full blocks. Imports no jax.

Blocks. The KV cache holds num_blocks pages of block_size tokens. Token position p of a sequence lives in page
block_table[p // block_size], slot p % block_size.

The null block. Page 0 (NULL_BLOCK) is reserved: never handed to a sequence, never freed, never cached. The
runner pads block tables with it and may point padding tokens' KV writes at it; its contents are garbage
but always safe to read, and no sequence ever attends to it through a real table entry. So a cache of
num_blocks pages holds (num_blocks - 1) * block_size tokens of real KV.

Prefix caching. A block whose block_size tokens are all known and computed is "full". Its hash chains over the
whole prefix: h_i = sha256(h_{i-1} || tokens of block i) with h_{-1} = sha256(cache_salt) (b"" without a salt;
with a LoRA adapter, sha256 of its key and the salt: KV computed under one adapter is never read under another),
so equal hashes mean equal token prefixes from position 0 (sha256: no practical collisions, unlike Python's
hash(), so a crafted prompt cannot read another request's KV). commit_full_blocks() registers full blocks in
hash -> block; a later sequence with the same prefix reuses those pages (refcount + 1) instead of recomputing
them. Only full blocks are shared, so a shared page is never written again. A lookup never covers the whole
sequence: the last token is always computed so the step has logits to sample from, hence hits are capped at
(num_tokens - 1) // block_size blocks.

When pages are registered. As in vLLM V1, the scheduler commits a chunk's full blocks when it schedules the
chunk, before the step has written them; so a sequence admitted later in the same step can hit a page that an
earlier one is completing in that step. The runner must therefore write every new token's KV (per layer)
before attention reads the cache: the usual write-then-attend order of paged attention. Every scheduled step
must also run in full, even for sequences finished or aborted after it was scheduled; the device running
steps in order is what makes freed pages safe to reuse.

Freeing and eviction. free() drops a sequence's references; a page reaching refcount 0 goes to one of two free
lists: uncached pages (no hash) to a plain pool, hashed pages to an LRU of cached-free pages that keep their
KV and hash. Allocation takes from the plain pool first and evicts the least recently freed cached page only
when the pool is empty, so cached prefixes live as long as memory allows. A sequence's pages enter the LRU
tail first, so its last (least shareable) blocks are evicted before its first ones. Cached-free pages count
as free in num_free_blocks and usage.

Two sequences computing the same prefix at the same time each get their own page; the first to commit
registers the hash and the other's page stays unhashed (freed as plain), as in vLLM.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from jaxllm.engine.sequence import Sequence

NULL_BLOCK = 0


def _salt_hash(salt: str | None, lora_key: str | None = None) -> bytes:
    if lora_key is not None:
        return hashlib.sha256(f"{lora_key}\0{salt or ''}".encode()).digest()
    return b"" if salt is None else hashlib.sha256(salt.encode()).digest()


def hash_block(parent: bytes, tokens: list[int]) -> bytes:
    """Chained hash of one full block: sha256(parent || tokens as int64)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}.")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # Pop from the end: pages come out in increasing order, which keeps small tests readable.
        self._free_plain: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # oldest first

        # Totals since start, in tokens (vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- capacity ----

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Pages an allocation can take: unused ones plus cached pages no sequence holds (evictable)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of usable pages held by sequences (vllm:kv_cache_usage_perc), 0..1."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- hashing ----

    def _update_block_hashes(self, seq: Sequence) -> list[bytes]:
        """Extends seq.block_hashes over the known full blocks (tokens only grow, so old hashes stay valid)."""
        hashes = seq.block_hashes
        bs = self.block_size
        n_full = seq.num_known_tokens // bs
        if len(hashes) < n_full:
            parent = hashes[-1] if hashes else _salt_hash(seq.cache_salt, seq.lora_key)
            for i in range(len(hashes), n_full):
                parent = hash_block(parent, seq.token_ids_slice(i * bs, (i + 1) * bs))
                hashes.append(parent)
        return hashes

    # ---- admission ----

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Pages holding the longest cached full-block prefix of seq's known tokens, capped so that at least
        the last token is computed. Changes nothing."""
        if not self.enable_prefix_caching or seq.skip_prefix_cache_read:
            return []
        max_blocks = (seq.num_known_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self._update_block_hashes(seq)[:max_blocks]:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_prompt(
        self, seq: Sequence, num_new_tokens: int | None = None, cached_blocks: list[int] | None = None
    ) -> int | None:
        """Admits seq (its block table must be empty): takes the cached prefix pages (cached_blocks, from
        find_cached_prefix(); looked up when None) and new pages for num_new_tokens more tokens (default: the
        rest of the sequence). Sets block_table and num_computed_tokens = cached tokens and returns that count,
        or returns None and changes nothing when the pages do not fit."""
        if seq.block_table:
            raise RuntimeError(f"{seq.seq_id}: allocate_prompt on a sequence that holds blocks")
        if cached_blocks is None:
            cached_blocks = self.find_cached_prefix(seq)
        num_cached = len(cached_blocks) * self.block_size
        if num_new_tokens is None:
            num_new_tokens = seq.num_tokens - num_cached
        num_fresh = self.blocks_needed(num_cached + num_new_tokens) - len(cached_blocks)
        # Cached pages nobody holds leave the free lists when taken, so they count against capacity too.
        num_revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if num_fresh + num_revived > self.num_free_blocks:
            return None
        for b in cached_blocks:
            if self.ref_counts[b] == 0:
                del self._free_cached[b]
            self.ref_counts[b] += 1
        seq.block_table = list(cached_blocks) + [self._take_free_block() for _ in range(num_fresh)]
        seq.num_computed_tokens = num_cached
        seq.num_committed_blocks = len(cached_blocks)
        if self.enable_prefix_caching and not seq.skip_prefix_cache_read:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_cached
        return num_cached

    # ---- growth ----

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def ensure_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grows block_table to cover num_computed_tokens + num_new_tokens tokens; False (nothing changed) when
        there are not enough free pages."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> int:
        """Frees seq's pages past those covering its first num_tokens positions (last first): the slots of
        speculated tokens the step rejected. Such pages hold no computed known token, so none is in the prefix
        cache. Returns how many pages were freed."""
        keep = self.blocks_needed(num_tokens)
        extra = seq.block_table[keep:]
        for block in reversed(extra):
            rc = self.ref_counts[block] - 1
            assert rc == 0 and self.block_hash[block] is None, (seq.seq_id, block, rc)
            self.ref_counts[block] = 0
            self._free_plain.append(block)
        del seq.block_table[keep:]
        return len(extra)

    def _take_free_block(self) -> int:
        if self._free_plain:
            block = self._free_plain.pop()
        else:
            block, _ = self._free_cached.popitem(last=False)  # evict the least recently freed cached page
            h = self.block_hash[block]
            self.block_hash[block] = None
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
        assert self.ref_counts[block] == 0
        self.ref_counts[block] = 1
        return block

    # ---- caching ----

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Registers the blocks of seq that are full of known, computed tokens in the prefix cache. Idempotent;
        the scheduler calls it after schedule() advances num_computed_tokens and after update() appends."""
        if not self.enable_prefix_caching:
            return
        num_known = len(seq.prompt_token_ids) + len(seq.output_token_ids)  # not the property: called per token
        n_full = min(seq.num_computed_tokens, num_known) // self.block_size
        if n_full <= seq.num_committed_blocks:
            return
        hashes = self._update_block_hashes(seq)
        for i in range(seq.num_committed_blocks, n_full):
            block, h = seq.block_table[i], hashes[i]
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block] = h
                self.hash_to_block[h] = block
        seq.num_committed_blocks = n_full

    def reset_prefix_cache(self) -> None:
        """Forgets every cached-free page (pages held by sequences stay registered)."""
        while self._free_cached:
            block, _ = self._free_cached.popitem(last=False)
            del self.hash_to_block[self.block_hash[block]]
            self.block_hash[block] = None
            self._free_plain.append(block)

    # ---- release ----

    def free(self, seq: Sequence) -> None:
        """Drops seq's references (last block first) and empties its block table."""
        for block in reversed(seq.block_table):
            rc = self.ref_counts[block] - 1
            if rc < 0:
                raise RuntimeError(f"double free of block {block} by {seq.seq_id}")
            self.ref_counts[block] = rc
            if rc == 0:
                if self.block_hash[block] is not None:
                    self._free_cached[block] = None
                else:
                    self._free_plain.append(block)
        seq.block_table = []
        seq.num_committed_blocks = 0

    # ---- checking ----

    def check_invariants(self, live_tables: list[list[int]] | None = None) -> None:
        """Asserts internal consistency; with live_tables (every live sequence's block table), also that
        refcounts equal the number of references. For tests."""
        free_plain, free_cached = set(self._free_plain), set(self._free_cached)
        assert len(free_plain) == len(self._free_plain), "a page is twice in the free pool"
        assert not free_plain & free_cached, "a page is in both free lists"
        assert NULL_BLOCK not in free_plain | free_cached and self.ref_counts[NULL_BLOCK] == 0
        assert self.block_hash[NULL_BLOCK] is None
        for b in range(1, self.num_blocks):
            rc = self.ref_counts[b]
            assert rc >= 0, f"negative refcount on block {b}"
            assert (rc == 0) == (b in free_plain or b in free_cached), f"block {b}: rc={rc} vs free lists"
            if b in free_cached:
                assert self.block_hash[b] is not None
            if b in free_plain:
                assert self.block_hash[b] is None
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h
        assert sum(h is not None for h in self.block_hash) == len(self.hash_to_block)
        if live_tables is not None:
            counts = [0] * self.num_blocks
            for table in live_tables:
                for b in table:
                    counts[b] += 1
            assert counts == self.ref_counts, "refcounts differ from the live block tables"

"""KV cache memory management (no compute): a pool of fixed-size blocks with prefix caching.

Why: contiguous per-request KV buffers fragment memory and cannot be shared. Fixed-size
blocks with per-request block tables let the engine admit requests by free-block count,
free them the moment a request ends, and share identical prefixes (system prompt plus
history re-sent every voice turn) between requests: a full block is identified by a hash
of its parent block's hash and its own tokens, and freed cached blocks stay reusable
until the LRU free list hands them out again.

A request's last block is usually partial, and a full-block cache never shares it: the
voice loop's history warm-up left up to 15 of the history's tokens (plus the new user
message) to prefill at every turn, and on a small CPU that prefill was most of the first
token's latency. So a freed partial block keeps its K/V as a *tail* (its parent
block's hash and the tokens it holds); a later request continuing the same prefix takes
the block over and computes only from where the two token sequences part. Taken over,
not shared: the new owner writes its own tokens into the rest of the block.

A freed *full* block is kept the same way: the words heard so far, prefilled while the user spoke, fill a block
that the final transcript parts from mid-way ("... fun fact about it" / "... about dogs"), and the whole block was
computed again. A full block stays cached under its hash for the requests that continue it exactly, so it is
never taken over: the start that matches is copied into a block of the new request's (``KVCopy``, run by the
model runner before the step's forward).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.request import Request

_ROOT_HASH = -1
TAILS_PER_PARENT = 8  # kept tails continuing one prefix (a lookup compares each; older ones are forgotten)


@dataclass(frozen=True)
class KVCopy:
    """Copy the K/V of the first ``num_tokens`` slots of block ``src`` into block ``dst`` (every layer)."""

    src: int
    dst: int
    num_tokens: int


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    # a free partial block whose K/V are kept: (hash of the block before it, the tokens it holds)
    tail: tuple[int, tuple[int, ...]] | None = None


class BlockPool:
    """All blocks, the LRU free list (front = evicted first) and the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, Block] = {}
        self._tails: dict[int, OrderedDict[int, Block]] = {}  # parent hash -> tails continuing it

    @property
    def num_free(self) -> int:
        """Blocks with no owner (cached-but-free blocks count: they are evictable)."""
        return len(self._free)

    def get_cached(self, block_hash: int) -> Block | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        self._forget_tail(block)
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on (cache-hit) blocks, pulling free ones off the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            self._forget_tail(block)  # its new owner writes past the kept tokens
            block.ref_cnt += 1

    def hold(self, block: Block) -> None:
        """Keep ``block`` from being handed out while it is copied from (it stays cached, and a tail)."""
        if block.ref_cnt == 0:
            del self._free[block.block_id]
        block.ref_cnt += 1

    def release(self, blocks: list[Block]) -> None:
        """Drop a reference; blocks reaching zero go to the end of the free list (evicted last)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache(self, block: Block, block_hash: int) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self._cached:  # first writer wins; a duplicate stays private
            self._cached[block_hash] = block
            block.block_hash = block_hash

    def cache_tail(self, block: Block, parent: int, tokens: tuple[int, ...]) -> None:
        """Keep the K/V of ``block`` (about to be freed, holding ``tokens`` after the block hashed ``parent``) for
        a request whose tokens part from them inside the block (a full block still cached under its hash is then
        copied from, not taken over)."""
        if not self.enable_caching or not tokens:
            return
        self._forget_tail(block)
        tails = self._tails.setdefault(parent, OrderedDict())
        tails[block.block_id] = block
        block.tail = (parent, tokens)
        while len(tails) > TAILS_PER_PARENT:
            _, oldest = tails.popitem(last=False)
            oldest.tail = None

    def best_tail(self, parent: int, tokens: Sequence[int]) -> tuple[Block | None, int]:
        """The kept tail after ``parent`` sharing the longest start with ``tokens``, and that length."""
        best, best_len = None, 0
        for block in self._tails.get(parent, {}).values():
            kept = block.tail[1]
            n = 0
            for a, b in zip(kept, tokens, strict=False):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = block, n
        return best, best_len

    def _forget_tail(self, block: Block) -> None:
        if block.tail is None:
            return
        parent = block.tail[0]
        block.tail = None
        tails = self._tails.get(parent)
        if tails is not None:
            tails.pop(block.block_id, None)
            if not tails:
                del self._tails[parent]

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
            block.tail = None
        self._cached.clear()
        self._tails.clear()


class KVCacheManager:
    """Per-request block tables on top of the pool, plus prefix-cache hit accounting."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._tables: dict[str, list[Block]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of each table already hashed
        self._copies: list[KVCopy] = []  # this step's copies of a cached block's start (take_copies)
        self._copied_from: list[Block] = []  # their sources, held until the step has run (end_copies)
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def reset_prefix_cache(self) -> bool:
        """Drop every prefix hash, only while no request holds blocks; returns whether it did."""
        if self.num_used_blocks:
            return False
        self.pool.reset_prefix_cache()
        return True

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def _update_hashes(self, req: Request, num_full_blocks: int) -> None:
        bs = self.block_size
        hashes = req.block_hashes
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash((parent, tuple(req.token_at(i * bs, (i + 1) * bs)))))

    def get_computed_blocks(self, req: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of ``req``: full blocks, then maybe a kept tail (a partial block, taken over, or
        a full one whose start is copied: ``allocate_slots``); and its length in tokens.

        At least one token is left to compute (the last one's logits are needed), and with
        ``prompt_logprobs_from`` every token from the one before it (``Request.computed_from``).
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        limit = req.computed_from
        max_blocks = limit // bs
        self._update_hashes(req, max_blocks)
        hits: list[Block] = []
        for h in req.block_hashes[:max_blocks]:
            block = self.pool.get_cached(h)
            if block is None:
                break
            hits.append(block)
        start = len(hits) * bs
        room = min(bs - 1, limit - start)  # a tail is partial, and the last token is computed
        if room > 0:
            parent = req.block_hashes[len(hits) - 1] if hits else _ROOT_HASH
            tail, n = self.pool.best_tail(parent, req.token_at(start, start + room))
            if tail is not None:
                return [*hits, tail], start + n
        return hits, start

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_query_tokens += num_query_tokens
        self.prefix_hit_tokens += num_hit_tokens

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed_blocks: list[Block] | None = None,
        reserve: int = 0,
        num_hit_tokens: int | None = None,
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``req`` (after any cache hits); False if no room.

        ``computed_blocks`` are prefix-cache hits for a request that has none yet, covering
        ``num_hit_tokens`` (default: all of them full; less when the last is a kept tail);
        ``reserve`` blocks must stay free afterwards (headroom for running requests to keep decoding).
        """
        table = self._tables.setdefault(req.request_id, [])
        computed_blocks = computed_blocks or []
        bs = self.block_size
        if num_hit_tokens is None:
            num_hit_tokens = len(computed_blocks) * bs
        num_computed = req.num_computed_tokens + num_hit_tokens
        total = num_computed + num_new_tokens
        # a full block still cached under its hash, matched only in part: its start is copied into a new block
        copied = computed_blocks[-1] if num_hit_tokens % bs and computed_blocks[-1].block_hash is not None else None
        need = -(-total // bs) - len(table) - len(computed_blocks) + (copied is not None)
        hits_on_free_list = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(need, 0) + reserve > self.pool.num_free - hits_on_free_list:
            if not table:
                del self._tables[req.request_id]
            return False
        if copied is not None:
            computed_blocks = computed_blocks[:-1]
            self.pool.hold(copied)
            self._copied_from.append(copied)
        self.pool.touch(computed_blocks)
        table.extend(computed_blocks)
        if need > 0:
            table.extend(self.pool.allocate(need))
        if copied is not None:
            self._copies.append(KVCopy(copied.block_id, table[len(computed_blocks)].block_id, num_hit_tokens % bs))
        if self.enable_prefix_caching:
            # Blocks that will be full once this step has run can be shared from now on: the
            # runner writes all K/V of a layer before any attention of that layer reads it.
            num_full = total // bs
            start = max(self._num_cached.get(req.request_id, 0), num_hit_tokens // bs)
            if num_full > start:
                self._update_hashes(req, num_full)
                for i in range(start, num_full):
                    self.pool.cache(table[i], req.block_hashes[i])
                self._num_cached[req.request_id] = num_full
        return True

    def take_copies(self) -> list[KVCopy]:
        """The copies this step's admissions need, to run before its forward."""
        copies, self._copies = self._copies, []
        return copies

    def end_copies(self) -> None:
        """The last step has run (its copies done): their sources go back to the free list or their owners."""
        sources, self._copied_from = self._copied_from, []
        self.pool.release(sources)

    def uncache_from(self, request_id: str, first_block: int) -> None:
        """Forget the prefix hashes of ``request_id``'s blocks from ``first_block`` on (a failed step
        registered them before their K/V were written); earlier blocks, shared hits included, keep theirs."""
        table = self._tables.get(request_id, [])
        for block in table[first_block:]:
            self.pool._evict(block)
        if request_id in self._num_cached:
            self._num_cached[request_id] = min(self._num_cached[request_id], first_block)

    def reset(self) -> None:
        """Free every request's blocks and forget every cached prefix (after a crash, nothing is trusted)."""
        for table in self._tables.values():
            for block in table:
                block.ref_cnt = 0
        self._tables.clear()
        self._num_cached.clear()
        self.pool = BlockPool(self.pool.num_blocks, self.enable_prefix_caching)

    def free(self, req: Request, keep_tail: bool = True) -> None:
        """Release all blocks of ``req`` (last first, so shared prefixes are evicted last).

        With ``keep_tail`` (its K/V are sound: not after a failed step) a partial last block
        keeps its K/V for a request that continues the same tokens.
        """
        table = self._tables.pop(req.request_id, None)
        self._num_cached.pop(req.request_id, None)
        if not table:
            return
        bs = self.block_size
        full, rest = divmod(req.num_computed_tokens, bs)
        if keep_tail and self.enable_prefix_caching:
            self._update_hashes(req, full)
            # the blocks it alone holds, full ones too (``BlockPool.cache_tail``), and a partial last one
            for i in range(min(full + (rest > 0), len(table))):
                if table[i].ref_cnt == 1:
                    parent = req.block_hashes[i - 1] if i else _ROOT_HASH
                    end = (i + 1) * bs if i < full else i * bs + rest
                    self.pool.cache_tail(table[i], parent, tuple(req.token_at(i * bs, end)))
        self.pool.release(list(reversed(table)))

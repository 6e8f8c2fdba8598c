"""``PrefixCache`` and ``block_hashes`` against a plain dict of token-tuple prefixes.

The reference names a cached block by the whole token prefix it ends (no hashing at all), keeps
its own recency order, and forgets a prefix's descendants by comparing token tuples, so it
cannot share a mistake with the chained hashes it checks.
"""

from __future__ import annotations

import random

import pytest

from paged_jax.engine.prefix_cache import ROOT, PrefixCache, block_hashes


class RefCache:
    """Prefix tuple -> block, LRU list of blocks (oldest first), evicted prefixes."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.cached: dict[tuple[int, ...], int] = {}
        self.recency: list[int] = []
        self.evicted: set[tuple[int, ...]] = set()
        self.hits = self.queries = 0

    def lookup(self, tokens):
        bs = self.bs
        usable = (len(tokens) - 1) // bs
        found, reason = [], None
        for j in range(usable):
            prefix = tuple(tokens[: (j + 1) * bs])
            if prefix not in self.cached:
                reason = "evicted" if prefix in self.evicted else "different tokens"
                break
            found.append(self.cached[prefix])
        if reason is None:
            reason = "partial block" if (len(tokens) - 1) % bs else "whole target"
        for b in found:
            self.recency.remove(b)
            self.recency.append(b)
        self.queries += max(len(tokens) - 1, 0)
        self.hits += len(found) * bs
        return found, reason

    def insert(self, before, chunk, block):
        """Enter ``chunk`` after the whole blocks ``before``. Refused: a prefix already
        cached, a block already indexed, and a block whose parent prefix is not cached (it
        could never be hit, and nothing would forget it when that parent is evicted)."""
        prefix = tuple(before) + tuple(chunk)
        if (prefix in self.cached or block in self.cached.values()
                or (before and tuple(before) not in self.cached)):
            return False
        self.cached[prefix] = block
        self.recency.append(block)
        self.evicted.discard(prefix)
        return True

    def evict(self, count, evictable):
        chosen = [b for b in self.recency if b in evictable][:count]
        roots = [p for p, b in self.cached.items() if b in chosen]
        dead = [p for p in self.cached if any(p[: len(r)] == r for r in roots)]
        gone = sorted(self.cached[p] for p in dead)
        for p in dead:
            self.recency.remove(self.cached.pop(p))
            self.evicted.add(p)
        return gone


# -- hashes -------------------------------------------------------------------------------


def test_a_block_hash_names_its_whole_prefix():
    rng = random.Random(0)
    bs = 2
    seqs = [[rng.randint(0, 1) for _ in range(rng.randint(0, 9))] for _ in range(300)]
    hashes = [block_hashes(s, bs) for s in seqs]
    for s, h in zip(seqs, hashes, strict=True):
        assert len(h) == len(s) // bs
        assert block_hashes(s[: len(h) * bs], bs) == h  # a partial tail adds nothing
    for a, ha in zip(seqs, hashes, strict=True):
        for b, hb in zip(seqs[:40], hashes[:40], strict=True):
            for j in range(min(len(ha), len(hb))):
                same_prefix = a[: (j + 1) * bs] == b[: (j + 1) * bs]
                assert (ha[j] == hb[j]) == same_prefix


def test_the_same_block_after_different_prefixes_hashes_differently():
    one, two = block_hashes([1, 2, 3, 4], 2), block_hashes([5, 6, 3, 4], 2)
    assert one[1] != two[1]
    assert block_hashes([3, 4], 2)[0] not in (one[1], two[1])
    # Token ids are hashed as int64s, so ids that share low bytes stay apart.
    assert block_hashes([1, 256], 2) != block_hashes([256, 1], 2)
    assert block_hashes([2**40], 1) != block_hashes([0], 1)


# -- lookup and its record -----------------------------------------------------------------


def filled(bs: int, *prefixes) -> PrefixCache:
    """A cache holding every whole block of each prefix, in chain order, blocks numbered
    from 100 in insertion order."""
    cache = PrefixCache(bs)
    block = 100
    for tokens in prefixes:
        parent = ROOT
        for j in range(len(tokens) // bs):
            parent, new = cache.insert(parent, tokens[j * bs:(j + 1) * bs], block)
            block += new
    return cache


def test_lookup_returns_the_longest_run_of_whole_blocks_short_of_the_last_token():
    cache = filled(2, [1, 2, 3, 4, 5, 6])
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7])[0] == [100, 101, 102]
    # The last token is always computed: a whole cached target gives back one block less.
    blocks, record = cache.lookup([1, 2, 3, 4, 5, 6])
    assert blocks == [100, 101] and record.hit_tokens == 4 and record.hit_blocks == 2
    assert record.target_tokens == 6
    assert cache.lookup([1, 2, 3, 9, 5, 6, 7])[0] == [100]
    assert cache.lookup([9, 2, 3, 4])[0] == []


@pytest.mark.parametrize("tokens, hit, reason", [
    ([1, 2, 3, 4, 5, 6, 7, 8], 3, "partial block"),  # block 3 holds the last token
    ([1, 2, 3, 4, 9, 9], 2, "partial block"),  # 1 token after 2 blocks, then the last
    ([1, 2, 3, 4, 5], 2, "whole target"),  # every token before the last is cached
    ([1, 2, 3, 4, 5, 6, 9], 3, "whole target"),
    ([1, 2, 3, 9, 5, 6, 7], 1, "different tokens"),
    ([7], 0, "whole target"),  # nothing before the last token to look up
])
def test_each_lookup_says_why_it_stopped(tokens, hit, reason):
    cache = filled(2, [1, 2, 3, 4, 5, 6])
    _, record = cache.lookup(tokens)
    assert (record.hit_blocks, record.reason) == (hit, reason)
    assert cache.last_lookup == record


def test_an_evicted_prefix_says_evicted_until_it_is_cached_again():
    cache = filled(2, [1, 2, 3, 4])
    assert cache.evict(1, {101}) == [101]
    _, record = cache.lookup([1, 2, 3, 4, 5])
    assert (record.hit_blocks, record.reason) == (1, "evicted")
    _, record = cache.lookup([1, 2, 3, 5, 5])  # a prefix never cached is not "evicted"
    assert record.reason == "different tokens"
    cache.insert(block_hashes([1, 2], 2)[0], [3, 4], 107)
    assert cache.lookup([1, 2, 3, 4, 5])[0] == [100, 107]


def test_a_hash_match_with_other_tokens_is_never_served():
    # Forge a collision through the public index: the entry of one block is filed under the
    # hash another prefix computes. The lookup must compare tokens (and parents) and refuse.
    cache = filled(2, [1, 2], [5, 6, 3, 4])
    h_12, h_78 = block_hashes([1, 2], 2)[0], block_hashes([7, 8], 2)[0]
    cache.entries[h_78] = cache.entries[h_12]
    blocks, record = cache.lookup([7, 8, 0])
    assert blocks == [] and record.reason == "different tokens"
    # Same block tokens, other parent: [1, 2, 3, 4]'s second block filed as [5, 6, 3, 4]'s.
    h_1234 = block_hashes([1, 2, 3, 4], 2)[1]
    cache.entries[h_1234] = cache.entries[block_hashes([5, 6, 3, 4], 2)[1]]
    cache.insert(ROOT, [1, 2], 100)  # already there: nothing changes
    blocks, record = cache.lookup([1, 2, 3, 4, 0])
    assert blocks == [100] and record.reason == "different tokens"


def test_insert_refuses_a_cached_prefix_or_a_block_already_indexed():
    cache = PrefixCache(2)
    h, new = cache.insert(ROOT, [1, 2], 5)
    assert new and h == block_hashes([1, 2], 2)[0]
    assert cache.insert(ROOT, [1, 2], 6) == (h, False)  # same prefix in another block
    assert cache.insert(ROOT, [3, 4], 5) == (block_hashes([3, 4], 2)[0], False)  # block taken
    assert len(cache) == 1 and cache.blocks() == [5]


# -- eviction ------------------------------------------------------------------------------


def test_eviction_is_least_recently_used_among_the_evictable_blocks():
    cache = filled(2, [1, 1], [2, 2], [3, 3])  # blocks 100, 101, 102
    cache.lookup([1, 1, 0])  # 100 becomes the most recent
    assert cache.evict(1, {100, 101, 102}) == [101]
    assert cache.evict(1, {100, 102}) == [102]
    assert cache.evict(5, {100, 999}) == [100]  # at most what is evictable and cached
    assert cache.evict(3, {100}) == [] and len(cache) == 0


def test_evicting_a_block_forgets_every_block_whose_chain_runs_through_it():
    cache = filled(2, [1, 2, 3, 4, 5, 6], [1, 2, 7, 8], [9, 9])  # 100-102, 103, 104
    assert cache.evict(1, {101}) == [101, 102]  # 102 hangs from 101, evictable or not
    assert sorted(cache.blocks()) == [100, 103, 104]
    assert cache.lookup([1, 2, 3, 4, 5, 6, 0])[1].reason == "evicted"
    assert cache.lookup([1, 2, 7, 8, 0])[0] == [100, 103]


def test_no_cached_block_outlives_an_evicted_ancestor_whatever_the_entry_order():
    # The engine enters a running sequence's blocks along its own chain, even where an
    # earlier block of that chain has just been evicted; that prefix may be entered again
    # later by another sequence, after the child. Evicting it then must leave no cached
    # block whose chain runs through it.
    bs = 2
    cache = PrefixCache(bs)
    h_a = block_hashes([1, 2], bs)[0]
    h_ab = block_hashes([1, 2, 3, 4], bs)[1]
    cache.insert(h_ab, [5, 6], 12)  # C, after A B, while A B are not cached
    cache.insert(ROOT, [1, 2], 10)  # A
    cache.insert(h_a, [3, 4], 11)  # B
    before = set(cache.blocks())
    assert set(cache.evict(1, {10})) == before
    assert len(cache) == 0 and cache.blocks() == []


def test_hit_rate_is_tokens_served_over_tokens_looked_up():
    cache = filled(4, list(range(8)))
    assert cache.hit_rate == 0.0
    cache.lookup(list(range(9)))  # 8 of 8
    cache.lookup(list(range(4)) + [9, 9, 9])  # 4 of 6
    cache.lookup([9])  # 0 of 0
    assert cache.hits == 12 and cache.queries == 14
    assert cache.hit_rate == pytest.approx(12 / 14)


# -- the whole cache against the reference ---------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_match_the_prefix_dict(seed):
    """Sequences grow block by block and enter each full block along their own chain, as the
    engine does; lookups and evictions of random evictable sets come in between."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 3])
    cache, ref = PrefixCache(bs), RefCache(bs)
    seqs: list[tuple[list[int], bytes]] = []  # (tokens entered so far, chain hash)
    next_block = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.4:
            if not seqs or rng.random() < 0.3:
                seqs.append(([], ROOT))
            i = rng.randrange(len(seqs))
            tokens, parent = seqs[i]
            chunk = [rng.randint(0, 1) for _ in range(bs)]
            block = next_block if rng.random() < 0.9 else rng.randrange(max(next_block, 1))
            next_block += 1
            h, new = cache.insert(parent, chunk, block)
            assert h == block_hashes(tokens + chunk, bs)[-1]
            assert new == ref.insert(tokens, chunk, block)
            seqs[i] = (tokens + chunk, h)
        elif op < 0.75:
            if seqs and rng.random() < 0.7:
                base = rng.choice(seqs)[0]
                tokens = base[: rng.randint(0, len(base))] + [
                    rng.randint(0, 1) for _ in range(rng.randint(0, 2 * bs))]
            else:
                tokens = [rng.randint(0, 1) for _ in range(rng.randint(0, 4 * bs))]
            blocks, record = cache.lookup(tokens)
            want_blocks, want_reason = ref.lookup(tokens)
            assert (blocks, record.reason) == (want_blocks, want_reason), tokens
            assert record.hit_tokens == len(blocks) * bs
        else:
            pool = cache.blocks()
            evictable = {b for b in pool if rng.random() < 0.5}
            count = rng.randint(0, 3)
            assert cache.evict(count, evictable) == ref.evict(count, evictable)
        assert sorted(cache.blocks()) == sorted(ref.cached.values())
        assert len(cache) == len(ref.cached)
    assert (cache.hits, cache.queries) == (ref.hits, ref.queries)

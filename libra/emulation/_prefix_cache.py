"""The emulated server's prefix cache: vLLM's automatic prefix caching, by hashed blocks."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


class PrefixCache:
    """vLLM-style automatic prefix caching, by blocks of ``block_tokens`` tokens.

    Block ``k`` of a sequence is known by a hash of the sequence's first ``k`` blocks, so
    a prompt hits the cache for as many leading blocks as some earlier prompt or reply
    shared with it (GRPO samples share their prompt; a trajectory's next turn starts
    with its previous turn). Blocks are evicted least recently used beyond
    ``capacity_tokens`` (the KV cache: vLLM keeps cached blocks in free KV memory; that
    they compete with running requests is not modelled).
    """

    def __init__(self, capacity_tokens: int, block_tokens: int = 256) -> None:
        self.capacity_blocks = max(1, capacity_tokens // block_tokens)
        self.block_tokens = block_tokens
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of which found in the cache
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def clear(self) -> None:
        """Forget every cached block (new weights make them stale); counters stay."""
        self._blocks.clear()

    def match(self, ids: list[int]) -> int:
        """Leading tokens of ``ids`` already cached (whole blocks; always leaves one out)."""
        return self.lookup(ids)[0]

    def insert(self, ids: list[int]) -> None:
        """Cache the whole blocks of ``ids``."""
        self.store(_BlockChain(self.block_tokens).extend(ids))

    def lookup(
        self, ids: list[int], packed: bytes | None = None
    ) -> tuple[int, _BlockChain, list[bytes]]:
        """Cached leading tokens of ``ids``, and the block chain over ``ids`` (to extend
        with the reply and :meth:`store`, without hashing the prompt twice); ``packed``
        is ``pack_ids(ids)`` if the caller has it."""
        chain = _BlockChain(self.block_tokens)
        digests = chain.extend(ids, packed)
        usable = (len(ids) - 1) // self.block_tokens  # vLLM computes at least one token
        hit = 0
        for digest in digests[:usable]:
            if digest not in self._blocks:
                break
            self._blocks.move_to_end(digest)
            hit += self.block_tokens
        self.queries += len(ids)
        self.hits += hit
        return hit, chain, digests

    def store(self, digests: list[bytes]) -> None:
        blocks = self._blocks
        for digest in digests:
            blocks[digest] = None
            blocks.move_to_end(digest)
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)


class _BlockChain:
    """Chained hashes of whole blocks: block ``k``'s digest covers blocks ``0..k``.
    Tokens short of a whole block wait for the next :meth:`extend`."""

    def __init__(self, block_tokens: int) -> None:
        self.block_bytes = 2 * block_tokens
        self.chain = hashlib.blake2b(digest_size=16)
        self.pending = b""

    def extend(self, ids: list[int], packed: bytes | None = None) -> list[bytes]:
        if packed is None:
            packed = array("H", ids).tobytes()  # ids are < 2**16 (checked before)
        data = self.pending + packed if self.pending else packed
        view, step, chain = memoryview(data), self.block_bytes, self.chain
        digests = []
        end = len(data) - len(data) % step
        for start in range(0, end, step):
            chain.update(view[start : start + step])
            digests.append(chain.copy().digest())
        self.pending = data[end:]
        return digests

"""The seed write-up's allocator, verbatim: the baseline for benchmarks and the walkthrough.

Kept as written (its ``pop()`` hands out the highest free block first, and nothing stops a
double free) so that comparisons are against the real thing. Not part of the public API.
"""


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int = 16):
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        self.ref_counts = [0] * num_blocks  # for copy-on-write sharing

    def allocate(self) -> int:
        if not self.free_blocks:
            raise RuntimeError("Out of KV cache blocks")
        block_id = self.free_blocks.pop()
        self.ref_counts[block_id] = 1
        return block_id

    def free(self, block_id: int):
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_blocks.append(block_id)

    def share(self, block_id: int):
        """Increment ref count for copy-on-write sharing."""
        self.ref_counts[block_id] += 1

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)


class RequestState:
    def __init__(self, request_id: int, prompt_len: int, allocator: BlockAllocator):
        self.request_id = request_id
        self.num_tokens = prompt_len
        self.block_table = []
        self.allocator = allocator

        # Allocate blocks for the prompt
        num_blocks_needed = (prompt_len + allocator.block_size - 1) // allocator.block_size
        for _ in range(num_blocks_needed):
            self.block_table.append(allocator.allocate())

    def append_token(self):
        """Called after each decode step."""
        self.num_tokens += 1
        # Check if we need a new block
        if self.num_tokens % self.allocator.block_size == 1 and self.num_tokens > 1:
            self.block_table.append(self.allocator.allocate())

    def release(self):
        """Free all blocks when request completes."""
        for block_id in self.block_table:
            self.allocator.free(block_id)
        self.block_table = []

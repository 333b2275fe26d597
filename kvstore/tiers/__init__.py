"""Storage tiers below the host pool. Each holds Full Blocks and says where a block is; none decides what to evict
(the index and its policy do) and none serves a byte it cannot prove is the one stored under the key."""

"""The plan: which sample every (rank, worker) reads, in which order (pure functions), the world
shape, and when each shard is first and last used (for the caches).
"""

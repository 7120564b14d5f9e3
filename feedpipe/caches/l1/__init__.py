"""L1, the node-local shard cache: each remote shard fetched once per node into a local
directory, checked, shared by every rank and worker, and evicted by the plan under a byte budget
that holds for the node.

``_entry``: one entry's files, and how it is checked, fetched, published and removed;
``_integrity``: what is checked before a file is served, and the stamps of a checked one;
``_eviction``: what leaves the directory (the entry needed furthest ahead first, and what killed
processes left behind); ``_budget``: the node-wide side of the byte budget. The cache
(:class:`~feedpipe.ShardCache`) is :mod:`feedpipe.caches._shards`.
"""

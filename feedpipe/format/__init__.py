"""The on-disk format: tar members and keys, the per-shard DALI index, manifest.json, reading a
shard (:class:`feedpipe.ShardReader`), writing one (:class:`feedpipe.ShardWriter`), and checking
them (``feedpipe index``, ``feedpipe verify``).
"""

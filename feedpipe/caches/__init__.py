"""The cache tiers below streaming, one sub-package each, as the docs name them
(docs/concepts.md, "Caches"):

- ``l1/``: the node-local L1 shard cache's parts: one entry's files, checks, fetch and publish
  (``_entry``, ``_integrity``), what leaves the directory (``_eviction``) and the node-wide byte
  budget (``_budget``). The cache itself (``_shards``: :class:`~feedpipe.ShardCache`), its
  prefetcher (``_prefetch``) and the manifest copy a warm cache starts from
  (``_manifest_copy``) sit beside this package for now, and belong in it.
- ``decoded/``: the decoded store (:class:`~feedpipe.DecodedStore`, ``_store``), its directory's
  files (``_files``), the record layout (``_layout``) and the buffers hits are served from
  (``_pool``).
- ``l2/``: the L2 function index (:class:`~feedpipe.FunctionIndex`, ``_index``), its entries
  (``_record``), their codec (``_codec``, never pickle) and its LMDB environments
  (``_lmdb_env``).

What the tiers share stays here: the stats shape every tier reports in (``_stats``), the
fingerprint of a function (``_fingerprint``) and the check for random transforms
(``_randomness``) that the decoded store and the L2 index key and guard by, the pass boundaries
they re-read the fingerprint at (``_passes``), and ``feedpipe cache``'s listing and clearing of
every tier under a directory (``_tiers``).
"""

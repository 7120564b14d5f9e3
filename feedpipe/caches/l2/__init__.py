"""L2, the function index: a persistent memo (LMDB) of an expensive deterministic per-sample
function, keyed by a fingerprint of the function (:mod:`feedpipe.caches._fingerprint`) and a hash
of its input.

``_index``: :class:`~feedpipe.FunctionIndex` and the memoised function; ``_record``: one entry's
key and stored bytes; ``_codec``: the value codec (no pickle, ever); ``_lmdb_env``: the LMDB
environments, one per directory and process.
"""

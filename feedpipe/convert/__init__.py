"""Conversion: ``feedpipe shard`` (listing, planning, the executors, the one-pass path, parts
and merge, Dask) and tables as a source.
"""

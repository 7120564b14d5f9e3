"""The decoded store (``FeedDataset(decoded_cache=)``): a deterministic transform's fixed-shape
outputs kept in a node-local memory-mapped file, so later epochs neither read shards nor decode.

``_store``: :class:`~feedpipe.DecodedStore`; ``_files``: the files of one store's directory and
how they are opened; ``_layout``: the fixed record layout of a transform's output (pure);
``_pool``: the record-sized buffers hits are served from.
"""

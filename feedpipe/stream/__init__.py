"""Streaming: :class:`feedpipe.FeedDataset`, :class:`feedpipe.FeedLoader`, the sample source
(:class:`feedpipe.ShardSet`), and the batch core: one loop, its named routes and their kernels.
"""

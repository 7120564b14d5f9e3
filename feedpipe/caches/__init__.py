"""The cache tiers below streaming: the node-local L1 shard cache (with its budget, checks and
prefetching), the decoded store, the L2 function index, and the stats shape they share.
"""

"""``feedpipe probe``: storage and pipeline throughput, the stage that bounds it, and advice.
"""

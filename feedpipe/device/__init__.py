"""To the device: :class:`feedpipe.DeviceLoader` (pinned, double-buffered, side-stream copies)
and :class:`feedpipe.DeviceCache` (the L3 tier).
"""

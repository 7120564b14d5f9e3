"""Private helpers every stage may use: sizes, progress bars, optional dependencies, file locks,
retries, where bytes come from (local paths or fsspec), process-pool start methods.
"""

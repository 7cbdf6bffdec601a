"""The node-local snapshot: what lands on a node's disk, and how it gets there safely.

``fetch`` lists and downloads the non-weight files; ``files`` classifies keys
(weights or not, where they may land); ``cache`` / ``staging`` / ``locks`` keep
snapshots atomic, never stale, never half-written; ``nonweights`` is the one entry
point the integrations call; ``handoff`` plans what vLLM is handed; ``requirements``
checks the streamer can be imported at all.
"""

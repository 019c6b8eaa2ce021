"""Session data: what the tracker keeps of sessions — records, tables and snapshots.

Owns the session's and turn's states and records, the sessions, turns (the prompt
outbox's rows) and snapshot-index tables, the snapshots' streams (rows of the
database, or an older meshnet's files), the model each session is on, and listing
sessions for operators. May import: ``tracker.nodes`` (routes), ``tracker.storage``.
What sessions *do* is ``tracker.sessions``.
"""

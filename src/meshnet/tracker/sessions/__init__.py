"""Sessions: their records and lifecycle, turns, the prompt outbox, parking, snapshots.

Owns the sessions' rows, running a turn on a route, parking and resuming their KV, the
snapshots (rows of the database), and retention (how long the tracker keeps what it no
longer needs).
May import: ``tracker.serving``, ``tracker.service`` and the rooms below them.
"""

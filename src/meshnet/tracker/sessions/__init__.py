"""Sessions at work: their lifecycle, turns, the prompt outbox, parking and retention.

Owns creating, parking, evicting and ending sessions, running a turn on a route (on
the model each session is on), delivering the outbox's turns, parking KV on every
hop, and retention (how long the tracker keeps what it no longer needs). What they
keep is ``tracker.session_data``. May import: ``tracker.serving``, ``tracker.service``
and the rooms below them.
"""

"""Watch: what operators see of the tracker, its metrics and its numbered event log.

Owns the Prometheus registry, the event log of sessions' and nodes' states, and the
watcher that writes it. May import: ``tracker.session_data``, ``tracker.nodes``,
``tracker.loops``.
"""

"""The tracker: registry, route driver, sessions, verification and the HTTP API's use cases.

Its rooms, lowest first: ``storage`` → ``accounting`` → ``nodes`` → ``links`` →
``trust`` → ``routing`` → ``session_data`` → ``watch`` → ``planning`` → ``healing`` →
``service`` (the ``Tracker``) → ``serving`` → ``sessions``; ``loops`` is shared by
all, and ``cli/tracker_process.py`` assembles them under the HTTP API. A room imports
only rooms before it: there is no import circle (the contract ``tracker-rooms`` in
pyproject.toml checks it).

The ``Tracker`` is composed, not inherited: it holds a ``RoutePlanner`` (planning:
routes chosen and reserved) and a ``Healer`` (healing: nodes marked down, failing
generations rerouted, spans healed), each given what it uses when the tracker is
made, as the route driver (``routing``) holds its relay, hop steps and failover.
"""

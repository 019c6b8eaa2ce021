"""The tracker: registry, route driver, sessions, verification and the HTTP API's use cases.

Its rooms, lowest first: ``storage`` → ``accounting`` → ``nodes`` → ``links`` →
``trust`` → ``routing`` → ``session_data`` → ``watch`` → ``planning`` → ``healing`` →
``service`` (the ``Tracker``) → ``serving`` → ``sessions``; ``loops`` is shared by
all, and ``cli/tracker_process.py`` assembles them under the HTTP API. A room imports
only rooms before it: there is no import circle (the contract ``tracker-rooms`` in
pyproject.toml checks it).
"""

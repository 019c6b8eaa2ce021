"""The tracker: registry, route driver, sessions, verification and the HTTP API's use cases.

Its rooms, lowest first: ``storage`` → ``accounting`` → ``nodes`` → ``links`` → ``trust`` →
``routing`` → ``watch`` → ``service`` (the ``Tracker``) → ``serving`` → ``sessions``, with
``main`` assembling them; ``loops`` is shared by all. A room imports only rooms before it.
"""

"""Serving: the models a tracker serves, where their layers are placed, route benchmarks.

Owns the served set (and its table), the placement controller (led by one tracker per
database: ``tracker.storage.leader_lease``), the model admin's use cases, referenced
models' manifests, and route benchmarks. May import: ``tracker.service`` and the
rooms below it (``watch``, ``routing``, ``trust``, ...).
"""

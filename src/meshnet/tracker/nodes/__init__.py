"""Nodes: what the tracker knows of its nodes, and the routes it plans over them.

Owns the node registry and its liveness rule, the durable mesh state (``store``), the
nodes' inventories, admission of capacity, and route planning (by layers and by cached
prefix). May import: ``tracker.accounting``, ``tracker.storage``.
"""

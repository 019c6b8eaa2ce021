"""Routing: driving one generation through a chain of nodes, and failing it over.

Owns a generation's state, its epoch on every hop, the decode ring, opening on cached
prefixes, the claims handed to the verifier, and the route driver. May import:
``tracker.trust``, ``tracker.links``, ``tracker.nodes``, ``tracker.accounting``.
"""

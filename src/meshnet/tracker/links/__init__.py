"""Links: the tracker's connections to nodes, and what it checks of what comes back.

Owns the shared gRPC channels, one hop's ``Forward`` stream and the nodes' commitments
checked off the wire. May import: ``tracker.nodes`` and the rooms below it.
"""

"""Trust: verifying untrusted nodes' work on trusted capacity.

Owns calibration before routing, the verifier's sampled re-runs, the check of the last
hop's sampling, trusted nodes as capacity, and throwaway sessions. May import:
``tracker.links``, ``tracker.nodes``, ``tracker.accounting``, ``tracker.storage``.
"""

"""Accounting: the work ledger, the verifier's verdicts beside it, and billing.

Owns what each attempt of work was, whether it was checked, and what it is worth to
tenants and nodes. May import: ``tracker.storage``, ``tracker.loops``.
"""

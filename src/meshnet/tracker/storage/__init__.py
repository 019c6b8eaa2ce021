"""Storage: one SQL interface over SQLite and PostgreSQL, its migrations, and leases.

Owns the database connection and its schema history, and the lease that makes one
tracker among those sharing a database the leader (of placement); nothing about what
the other rows mean. May import: ``tracker.loops`` only (the bottom room).
"""

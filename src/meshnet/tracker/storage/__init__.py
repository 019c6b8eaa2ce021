"""Storage: one SQL interface over SQLite and PostgreSQL, and the numbered migrations.

Owns the database connection and its schema history, nothing about what the rows mean.
May import: nothing else from the tracker (the bottom room).
"""

"""Who may call what: the mesh secret and node credentials, signed calls between
tracker and nodes, tracker-issued peer tokens, tenants' API keys and the admin token
(docs/design.md §13)."""

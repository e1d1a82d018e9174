"""Model implementations (our own forward passes over paged attention) and their registry."""

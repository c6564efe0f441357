"""Fleet simulator for studying routing policies at scale."""

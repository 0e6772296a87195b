"""connectors package (built in a later issue)."""

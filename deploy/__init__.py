"""deploy package (built in a later issue)."""

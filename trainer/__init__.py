"""trainer package (built in a later issue)."""

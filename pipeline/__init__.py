"""pipeline package (built in a later issue)."""

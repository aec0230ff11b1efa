"""Code the tests share (import as `helpers.<module>`: tests/ is on the path)."""

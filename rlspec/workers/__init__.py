"""The Ray actors, each a plain class (built without Ray in tests) that owns one device."""

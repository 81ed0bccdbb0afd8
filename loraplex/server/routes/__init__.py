"""HTTP routes: thin functions over the services (no SQL, no engine internals)."""

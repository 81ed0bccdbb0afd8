"""Benchmarks that ship with loraplex (`loraplex bench ...`)."""

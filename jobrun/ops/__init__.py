"""Ops: signatures as data, implementations imported lazily."""

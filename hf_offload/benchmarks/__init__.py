"""Measurements behind the package's defaults and claims (run as modules, not in the tests)."""

"""Tools run by hand to check a change (not tests: pytest collects nothing here)."""

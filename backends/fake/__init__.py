"""fake backend."""

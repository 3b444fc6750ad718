"""amd backend."""

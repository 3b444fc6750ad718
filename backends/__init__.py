"""Vendor backends behind agent.core.backend.Backend."""

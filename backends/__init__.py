"""Vendor backends behind agent.backend.Backend."""

"""The Kubernetes CEL evaluator the tests use: the agent's own (`agent.core.cel`)."""

from agent.core.cel import CelError, CelQuantity, CelSemver, match_attribute, matches

__all__ = ["CelError", "CelQuantity", "CelSemver", "match_attribute", "matches"]

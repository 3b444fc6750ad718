"""CEL conformance: the published test cases of cel-spec, cel-go and Kubernetes run through agent.core.cel.

Not part of CI (it reads checkouts of those repositories); run ``python -m benchmarks.cel_conformance``.
"""

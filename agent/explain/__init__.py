"""``dra-agent explain``: why a ResourceClaim gets (or does not get) this node's devices.

Process level, like `agent.runner`: it reads the API server (`agent.kube.client`) or files, the
claim checkpoint and CDI specs (`agent.claims`), and evaluates selectors with `agent.core.cel`.
Imports: anything below the process modules; nothing imports it but `agent.cli`.
"""

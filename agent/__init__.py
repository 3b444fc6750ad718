"""dra-agent: a multi-vendor Kubernetes DRA node agent."""

__version__ = "0.1.0"

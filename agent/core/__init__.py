"""The vendor-neutral device model and what every layer uses: backend protocol, inventory, errors, logs.

Imports nothing else of `agent`.
"""

"""Multi-node execution on an existing distributed engine.

krex does not grow its own cluster manager: an integration puts one krex node
runtime (daemon, warm workers, regions, enforcement) on every node of a
cluster that an engine already runs, and routes benchmarking programs to those
nodes.  ``krex.integrations.ray`` (importable as ``krex.ray``, extra ``ray``)
is the Ray integration; see docs/cluster.md.
"""

"""Multi-node execution on an existing distributed engine.

krex does not grow its own cluster manager: an integration puts one krex node
runtime (daemon, warm workers, regions, enforcement) on every node of a
cluster that an engine already runs, and routes benchmarking programs to those
nodes.  In: Python benchmarking programs submitted from the engine's driver.
Out: their results, with the regions each node's daemon recorded for them.
``krex.integrations.ray`` (importable as ``krex.ray``, extra ``ray``) is the
Ray integration; see docs/cluster.md.
"""

"""atoll.node: the node agent, profiler, stage runtime, pipeline schedule, peer transport, checkpoints."""

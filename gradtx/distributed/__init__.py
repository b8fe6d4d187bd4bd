"""The sharding plan read from placements, reductions, pipeline and context parallelism."""

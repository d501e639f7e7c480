"""The rules both the planner and the runtime obey: what tensor parallelism shards, plan validity,
pipeline schedules, gradient buckets. No SymPy, OR-Tools or cost model here (docs/layout.md)."""

"""The training cost model: seconds and bytes of one step for a parallel layout (cost.estimate composes
the pieces: layout, compiled table, one block, model state and its sync, the pipeline)."""

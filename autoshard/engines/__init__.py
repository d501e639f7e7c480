"""Plans in the words of the engines people run, and layouts read back from them.

* `training_run.py`: `TrainingRun`, one training layout as an engine states it (mesh, micro-batch,
  ZeRO, recompute and sequence parallelism per pipeline rank, schedule, virtual stages, layers per
  rank), read off a `Plan` exactly, priced by the planner's own `planner.predict` (so a plan and the
  same layout typed by hand get the same figures), and projected onto what an engine can express.
* `megatron.py` (Megatron-LM / MindSpeed-LLM arguments), `torchtitan.py` (`torchtitan.train` command
  line), `accelerate.py` (`ParallelismConfig` + FSDP2 plugin): emit a run; Megatron and torchtitan
  also parse their command lines back into a `TrainingRun` (`autoshard price --from-megatron` /
  `--from-torchtitan`).
* `serving.py`: the vLLM and SGLang launch commands of a serving plan.
"""

"""The tensor-parallel collectives of one block, counted and sized off the sharding table (rules/sharding.py): each
row-parallel linear's all-reduce (or, under sequence parallelism, reduce-scatter), each region entry's input-gradient
all-reduce, HF's gathered linears' all-gathers. What the cost model prices (passes/cost/block.py, sequence_cost.py);
the runtime runs the same collectives from the same roles (runtime/tensor_parallel.py). Contract: docs/modules/rules.md.
"""

from __future__ import annotations

from autoshard.ir import BlockKind
from autoshard.model_spec import ModelSpec
from autoshard.rules.sharding import Strategy, size, table


def row_parallel_count(spec: ModelSpec, kind: BlockKind, *, under: str = "") -> int:
    """Row-parallel roles of block `kind` (each all-reduces its output in forward), optionally only
    those under module `under` (what selective recompute reruns)."""
    return sum(1 for r in table(spec) if r.block is kind and r.strategy is Strategy.ROWWISE
               and (not under or r.path.startswith(under + ".")))


def region_output_widths(spec: ModelSpec) -> tuple[int, ...]:
    """The output widths of one layer's row-parallel linears whose summed output enters a TP region again
    (`Role.output_region`: Mamba-1's x_proj, dt_rank + 2 x state wide, its fan): each all-reduces that width in
    forward and its gradient in backward, under sequence parallelism too (no reduce-scatter inside a region)."""
    return tuple(size(spec, r.fan) for r in table(spec) if r.block is BlockKind.LAYER and r.output_region)


def gathered_widths(spec: ModelSpec, strategy: Strategy) -> tuple[int, ...]:
    """The widths of one layer's gathered linears (`Role.gathered`) of `strategy`: a colwise one's output (all-gathered
    in forward), a rowwise one's input (its gradient all-gathered in backward)."""
    return tuple(size(spec, r.pieces[0].length) for r in table(spec)
                 if r.block is BlockKind.LAYER and r.gathered and r.strategy is strategy)


def tp_entry_count(spec: ModelSpec) -> int:
    """Input-gradient all-reduces of one layer in backward: one per row-parallel linear's region (Megatron's
    pair), plus each gathered colwise linear, which enters tp itself, less each gathered rowwise linear, whose
    whole input enters no region (`Role.gathered`; runtime/tensor_parallel.py)."""
    return (row_parallel_count(spec, BlockKind.LAYER) + len(gathered_widths(spec, Strategy.COLWISE))
            - len(gathered_widths(spec, Strategy.ROWWISE)))

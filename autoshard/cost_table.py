"""The symbolic cost table (passes only): per-node costs of one training step as SymPy expressions.

Terms: `B` and `S` are the SymPy symbols for micro-batch size and sequence length used by every
cost expression. `passes/capture/shapes.py` builds a `CostTable`, `passes/cost/cost.py` compiles it to numbers.
These types live apart from `autoshard.ir` (the plain Mesh / Plan / Stage / ShardProgram the
runtime reads) so that importing the runtime never loads SymPy (DESIGN.md, "Arrows point one way").
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from autoshard.ir import BlockKind, OpKind

# the target prefixes of the forward nodes of the scans substituted at capture (the ops registered by
# passes/capture/selective_scan.py and passes/capture/gated_delta_rule.py as autoshard::<name>); kept here, where
# a plan of a shipped table reads them without importing torch
SCAN_TARGETS = ("autoshard.selective_scan.", "autoshard.gated_delta_rule.")
DELTA_RULE_TARGET = "autoshard.gated_delta_rule"  # the gated delta rule's forward and backward ops' targets begin so

B, S = sympy.symbols("b s", positive=True, integer=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class RegionTag:
    """The fused region a node is in (passes/capture/fused_patterns.py finds them on the graph): the kernel that
    replaces it ("rmsnorm", "swiglu", "rope", "moe_router"), the region's name (its output node) and its sizes
    per token read off the graph, which the kernel's cost rule reads (passes/cost/fused_regions.py)."""

    kernel: str
    key: str
    size: tuple[float, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeCost:
    """Cost of one aten node of the captured graph, as SymPy expressions in `B` and `S`.

    `phase` is "fwd" or "bwd". `saved_bytes` is what this (forward) node's output keeps
    alive for the backward pass (0 for nodes whose output backward does not read).
    `gemm` is (batch, m, n, k) for matmul-like nodes: the shape GEMM efficiency depends on.
    `region`: the fused region the node is in, None for none.
    """

    name: str
    target: str
    kind: OpKind
    phase: str
    module_path: str
    block: int | None
    flops: sympy.Expr
    bytes_read: sympy.Expr
    bytes_written: sympy.Expr
    saved_bytes: sympy.Expr
    gemm: tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr] | None = None
    region: RegionTag | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockCost:
    """The nodes of one block of the model; a LAYER block stands for `count` identical layers (of one
    kind: a model with several layer kinds has a LAYER block per kind, named by the kind)."""

    name: str
    kind: BlockKind
    count: int
    params: int  # parameter count of ONE instance of the block
    nodes: tuple[NodeCost, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class CostTable:
    """Per-block symbolic costs of one training step (forward and backward) of a model.

    `layer_kinds`: the name of the LAYER block of every layer, in order, when the model's layers are of
    several kinds (passes/capture/layer_kinds.py); empty for the one-kind case, whose one LAYER block stands
    for every layer. `shared_params`: parameters several layers hold (Zamba2's shared block), counted
    once, in no block."""

    model: str
    blocks: tuple[BlockCost, ...]
    layer_kinds: tuple[str, ...] = ()
    shared_params: int = 0

    @property
    def mixed(self) -> bool:
        """Whether the layers are of several kinds."""
        return bool(self.layer_kinds)

    def layer_blocks(self) -> tuple[BlockCost, ...]:
        """The LAYER block of every kind, in the order of their first layer."""
        return tuple(b for b in self.blocks if b.kind is BlockKind.LAYER)

    def mixer_layers(self, *, mamba2: bool) -> tuple[int, int]:
        """(attention layers, Mamba-2 layers), read off each layer kind's forward graph: attention where it
        calls an attention op; the SSD where its scan was substituted by the fused kernel or, with none
        substituted, where a layer of a Mamba-2-family model (`mamba2`) runs its causal conv1d."""
        attention = ssd = 0
        for block in (self.layer_blocks() if self.mixed else ()):
            fwd = [n for n in block.nodes if n.phase == "fwd"]
            attention += block.count * bool(attention_modules(fwd))
            ssd += block.count * any(is_scan_op(n, mamba2=mamba2) for n in fwd)
        return attention, ssd

    def scan_layers(self) -> tuple[float, int]:
        """(forward FLOPs per token of the recurrent scans of all layers, layers holding one with no attention op):
        the scans substituted at capture (`SCAN_TARGETS`: Mamba-1's selective scan, the gated delta rule), read
        off the graph."""
        flops, bare = 0.0, 0
        for block in self.layer_blocks():
            fwd = [n for n in block.nodes if n.phase == "fwd"]
            scans = [n for n in fwd if n.target.startswith(SCAN_TARGETS)]
            flops += block.count * sum(float(sympy.sympify(n.flops).subs({B: 1, S: 1})) for n in scans)
            bare += block.count * (bool(scans) and not any(is_attention_op(n) for n in fwd))
        return flops, bare

    @property
    def params(self) -> int:
        """Parameters of the whole model (HF's count: every parameter once)."""
        return sum(b.params * b.count for b in self.blocks) + self.shared_params

    def block(self, kind: BlockKind) -> BlockCost:
        if kind is BlockKind.LAYER and self.mixed:
            raise ValueError(f"{self.model} has {len(self.layer_blocks())} layer kinds "
                             f"({', '.join(b.name for b in self.layer_blocks())}): read them with layer_blocks()")
        for block in self.blocks:
            if block.kind is kind:
                return block
        raise KeyError(kind)

    def saved_bytes(self, batch: int, seq: int) -> float:
        """Bytes the forward of one whole-model step keeps for backward at (batch, seq), as traced
        (no parallelism, no recompute): what `saved_activation_bytes` of tests/runtime/measure.py measures."""
        return sum(float(sympy.sympify(n.saved_bytes).subs({B: batch, S: seq})) * blk.count
                   for blk in self.blocks for n in blk.nodes)


def is_attention_op(node: NodeCost) -> bool:
    """An attention kernel of the traced graph (HF's sdpa / flash call): where a layer mixes by attention."""
    return "scaled_dot_product" in node.target or "flash_attention" in node.target


def attention_modules(nodes) -> set[str]:
    """Module paths of the forward `nodes` that mix the sequence by attention: the module of an attention kernel
    (HF's sdpa / flash call) or of a matmul quadratic in the sequence -- eager attention (HF's
    `eager_attention_forward`, a class with no sdpa path) runs its scores q k^T and their product with v as two
    bmm of s x s, the only matmuls of a decoder layer whose FLOPs grow as s^2 (a chunked scan's grow as s)."""
    return {n.module_path for n in nodes if n.phase == "fwd" and (
        is_attention_op(n) or (n.kind is OpKind.MATMUL and degree_in_s(n.flops) >= 2))}


def degree_in_s(expr) -> int:
    """Degree of a node's FLOPs in the sequence length (0 when not a polynomial in S)."""
    try:
        return int(sympy.degree(sympy.expand(expr), S))
    except (sympy.PolynomialError, TypeError, ValueError):
        return 0


def is_scan_op(node: NodeCost, *, mamba2: bool) -> bool:
    """The SSD of the traced graph: its scan substituted by the fused kernel or, with none substituted, the
    causal conv1d of a model that holds Mamba-2 mixers (`mamba2`)."""
    return node.target.startswith("autoshard.ssd_chunk_scan") or (mamba2 and "convolution" in node.target)

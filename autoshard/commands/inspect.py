"""`autoshard inspect`: per-block parameters, training FLOPs per token and activation bytes of a model.

The numbers are read off the captured joint graph (passes/capture/capture + passes/capture/shapes), with the regions
of fused kernels substituted (passes/capture/kernels; `--hardware` picks the device whose kernels apply),
evaluated at the given micro-batch and sequence length. `--json` prints one object (see `summarize`).

Mixture of experts (Mixtral, Qwen2-MoE): the FLOPs are those executed, each token through its
top-k experts (the graph's `_grouped_mm` rows), not through all of them; the parameters are shown
as expert (the routed experts, sharded over ep) and dense (everything else: attention, router,
shared expert, embedding, head; replicated over ep), with the parameters active per token
(dense + top_k / experts of the expert parameters), on which the model-FLOPs formula 6*N is taken.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import sympy

from autoshard.commands.common import cost_table_for
from autoshard.cost_table import B, S, BlockCost, CostTable
from autoshard.ir import POSITIVE_INT, OpKind
from autoshard.model_spec import Mixer, ModelSpec
from autoshard.passes.cost.compiled import routes_tokens

DEFAULT_SEQ_LEN = 4096


def add_parser(sub) -> None:
    p = sub.add_parser(
        "inspect", help="per-block table: parameters, training FLOPs/token, activation bytes",
        description="Capture the model's joint forward+backward graph on fake tensors (no weights are "
        "allocated) and print, per block (embedding, one decoder layer x count, head; a model whose layers are "
        "of several kinds, a hybrid, has a row per kind with its count), the parameters, "
        "training FLOPs per token (forward + backward), the bytes of activations saved for backward per "
        "token, and the matmul vs vector (memory-bound) share of the FLOPs.")
    p.add_argument("--model", required=True, metavar="M",
                   help="a preset name (e.g. llama-7b, mamba2-1b, llama-tiny) or package.module:factory")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, metavar="S",
                   help=f"sequence length (default {DEFAULT_SEQ_LEN})")
    p.add_argument("--micro-batch", type=int, default=1, metavar="B", help="micro-batch size (default 1)")
    p.add_argument("--hardware", metavar="H", default=None,
                   help="price the regions of the fused kernels this device profile has (a profile name or "
                        "profile.json; default: every fused kernel autoshard knows, see docs/kernels.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run)


def run(args) -> int:
    for flag, value in (("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch)):
        POSITIVE_INT.check(flag, value)
    kernels = None
    if args.hardware is not None:
        from autoshard.hardware import load_hardware

        kernels = load_hardware(args.hardware).kernels
    spec, table = cost_table_for(args.model, spinner=not args.json, kernels=kernels)
    summary = summarize(spec, table, seq_len=args.seq_len, micro_batch=args.micro_batch)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        render(summary)
    return 0


def _at(expr: sympy.Expr, b: int, s: int) -> float:
    return float(sympy.sympify(expr).subs({B: b, S: s}))


def _block_summary(block: BlockCost, b: int, s: int) -> dict[str, Any]:
    tokens = b * s
    total = lambda attr, kinds=None: _at(sympy.Add(*(getattr(n, attr) for n in block.nodes  # noqa: E731
                                                       if kinds is None or n.kind in kinds)), b, s) * block.count
    flops = total("flops")
    matmul = total("flops", (OpKind.MATMUL,))
    moved = total("bytes_read") + total("bytes_written")
    return {
        "name": block.name, "kind": block.kind.value, "count": block.count, "params": block.params,
        "params_total": block.params * block.count,
        "flops_per_token": flops / tokens, "matmul_flops_per_token": matmul / tokens,
        "vector_flops_per_token": (flops - matmul) / tokens,
        "matmul_share": matmul / flops if flops else 0.0, "vector_share": 1 - matmul / flops if flops else 0.0,
        "saved_bytes_per_token": total("saved_bytes") / tokens,
        "bytes_moved_per_token": moved / tokens,
        "vector_bytes_moved_per_token": (total("bytes_read", (OpKind.VECTOR,)) +
                                         total("bytes_written", (OpKind.VECTOR,))) / tokens,
        "nodes": len(block.nodes),
    }


def ssd_flops_per_token(spec: ModelSpec, s: int) -> float:
    """Mamba-2 SSD training FLOPs per token, all layers (arXiv 2405.21060 section 8.3, forward x3)."""
    l, h, p, n = spec.chunk, spec.heads, spec.head_dim, spec.state
    c = s / l
    forward = 2 * (c * h * l * l * n + c * h * l * l * p + c * h * l * p * n + h * c * p * n + c * h * p * n * l)
    return 3 * forward * spec.layers / s


def summarize(spec: ModelSpec, table: CostTable, *, seq_len: int, micro_batch: int = 1) -> dict[str, Any]:
    """The numbers `inspect` prints, as one JSON-able dict."""
    blocks = [_block_summary(block, micro_batch, seq_len) for block in table.blocks]
    params = sum(blk["params_total"] for blk in blocks) + table.shared_params
    moe = moe_params(spec, params, moe_layers=sum(b.count for b in table.layer_blocks() if routes_tokens(b))
                     if table.mixed else spec.layers)
    scan, no_attention = table.scan_layers()  # the scans substituted at capture (Mamba-1's, the delta rule)
    if table.mixed:
        attention, ssd = table.mixer_layers(mamba2=spec.mixer is Mixer.SSD)
        model_flops = 6 * params + 12 * attention * spec.hidden * seq_len
        if ssd:
            model_flops += ssd_flops_per_token(spec, seq_len) * ssd / spec.layers
        formula = (f"6*N + 12*d*s per attention layer ({attention})"
                   + (f" + SSD per Mamba-2 layer ({ssd}; arXiv 2405.21060 sec. 8.3)" if ssd else ""))
        if scan:
            model_flops += 3 * scan
            formula += (" + 3 x the forward FLOPs of the scans substituted at capture (Mamba-1's selective scan: "
                        "9*d_inner*d_state, state-spaces/mamba issue 110; the gated delta rule: fla's chunked kernel)")
    elif spec.mixer is Mixer.SSD:
        model_flops = 6 * params + ssd_flops_per_token(spec, seq_len)
        formula = "6*N + SSD (arXiv 2405.21060 sec. 8.3, training = 3x forward)"
    elif moe:
        model_flops = 6 * moe["active_params"] + 12 * spec.layers * spec.hidden * seq_len
        formula = "6*N_active + 12*L*d*s (N_active: dense + top_k/experts of the expert parameters)"
    elif no_attention:
        model_flops = 6 * params + 3 * scan
        formula = "6*N + 3 x (9*d_inner*d_state + 2*d_inner) per layer (selective scan, state-spaces/mamba issue 110)"
    else:
        model_flops = 6 * params + 12 * spec.layers * spec.hidden * seq_len
        formula = "6*N + 12*L*d*s"
    flops = sum(blk["flops_per_token"] for blk in blocks)
    matmul = sum(blk["matmul_flops_per_token"] for blk in blocks)
    return {
        "model": table.model, "seq_len": seq_len, "micro_batch": micro_batch, "params": int(params), **moe,
        "flops_per_token": flops, "matmul_flops_per_token": matmul, "vector_flops_per_token": flops - matmul,
        "matmul_share": matmul / flops if flops else 0.0,
        "model_flops_per_token": float(model_flops), "model_flops_formula": formula,
        "saved_bytes_per_token": sum(blk["saved_bytes_per_token"] for blk in blocks),
        "bytes_moved_per_token": sum(blk["bytes_moved_per_token"] for blk in blocks),
        "blocks": blocks, "fused_kernels": fused_kernels(table),
        **({"layer_kinds": list(table.layer_kinds), "shared_params": table.shared_params} if table.mixed else {}),
    }


def fused_kernels(table: CostTable) -> list[dict[str, Any]]:
    """The regions kernel substitution replaced (passes/capture/kernels): kernel, module, block, instances."""
    out = []
    for block in table.blocks:
        for node in block.nodes:
            if node.phase == "fwd" and node.target.startswith("autoshard."):
                out.append({"kernel": node.target.removeprefix("autoshard.").removesuffix(".default"), "module": node.module_path,
                            "block": block.name, "instances": block.count})
    return out


def moe_params(spec: ModelSpec, params: float, *, moe_layers: int) -> dict[str, Any]:
    """Expert / dense / active-per-token parameters of a MoE model whose `moe_layers` layers hold routed experts
    (a mixed stack: those whose graph routes tokens; the others are dense), an empty dict for a dense one."""
    if not spec.is_moe:
        return {}
    expert = spec.expert_params * moe_layers
    dense = int(params) - expert
    return {"experts": spec.experts, "top_k": spec.top_k, "expert_params": expert, "dense_params": dense,
            "active_params": dense + expert * spec.top_k // spec.experts}


def _runs(kinds: list[str]) -> str:
    """`a x3, b, a x2` for the layer sequence a a a b a a."""
    runs: list[list] = []
    for k in kinds:
        if runs and runs[-1][0] == k:
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
    return ", ".join(k if n == 1 else f"{k} x{n}" for k, n in runs)


def _si(x: float) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f}{prefix}"
    return f"{x:.0f}"


def _bytes(x: float) -> str:
    for factor, prefix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(x) >= factor:
            return f"{x / factor:.2f} {prefix}"
    return f"{x:.0f} B"


def render(summary: dict[str, Any], *, file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{summary['model']}: micro-batch {summary['micro_batch']}, seq-len {summary['seq_len']}; "
                  "per token, training (forward + backward)", title_justify="left")
    for col in ("block" if not summary.get("layer_kinds") else "block / layer kind", "count", "params", "FLOPs", "matmul", "vector", "saved act.", "bytes moved"):
        table.add_column(col, justify="left" if col == "block" else "right")
    for blk in summary["blocks"]:
        table.add_row(blk["name"], str(blk["count"]), f"{blk['params']:,}", _si(blk["flops_per_token"]),
                      f"{blk['matmul_share']:.1%}", f"{blk['vector_share']:.1%}",
                      _bytes(blk["saved_bytes_per_token"]), _bytes(blk["bytes_moved_per_token"]))
    table.add_section()
    table.add_row("total", "", f"{summary['params']:,}", _si(summary["flops_per_token"]),
                  f"{summary['matmul_share']:.1%}", f"{1 - summary['matmul_share']:.1%}",
                  _bytes(summary["saved_bytes_per_token"]), _bytes(summary["bytes_moved_per_token"]))
    out = file or sys.stdout
    console = Console(file=out, width=None if out.isatty() else 110)
    console.print(table)
    if "expert_params" in summary:
        console.print(f"mixture of experts: {summary['experts']} experts, top-{summary['top_k']}; parameters: "
                      f"expert {summary['expert_params']:,} (sharded over ep), dense {summary['dense_params']:,}, "
                      f"active per token {summary['active_params']:,}; FLOPs are those executed (top-k experts).")
    if summary.get("layer_kinds"):
        shared = f"; {summary['shared_params']:,} parameters shared by several layers, counted once in the total" \
            if summary["shared_params"] else ""
        console.print(f"layers of {len(set(summary['layer_kinds']))} kinds, in order: "
                      f"{_runs(summary['layer_kinds'])}{shared}")
    console.print(f"params: one instance of each block; total: all. Model FLOPs per token "
                  f"({summary['model_flops_formula']}): {_si(summary['model_flops_per_token'])}; "
                  f"counted from the graph: {_si(summary['flops_per_token'])}.")
    for k in summary["fused_kernels"]:
        what = f"{k['block']}s" if k["block"] == "layer" else f"{k['block']} layers"
        layers = f" (x{k['instances']} {what})" if k["instances"] > 1 else ""
        console.print(f"fused kernel: {k['kernel']} replaces the traced ops of {k['module']}{layers}")
    if not summary["fused_kernels"]:
        console.print("fused kernels: none substituted (every op is priced as traced)")

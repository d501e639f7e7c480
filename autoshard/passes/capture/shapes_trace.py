"""The tracing half of passes/capture/shapes: trace the 1-layer copy of a model at the sample shapes, measure
every node, and interpolate the symbolic table (the method is described in passes/capture/shapes.py's
docstring). Imported only when a table is built, not when one is read from a cache or the package,
so reading a table needs neither torch nor transformers."""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Callable, Sequence

import sympy
import torch
from torch import fx, nn

from autoshard.errors import CaptureError
from autoshard.cost_table import B, S, BlockCost, CostTable, NodeCost, RegionTag
from autoshard.ir import BlockKind, OpKind
from autoshard.model_spec import Mixer, ModelSpec
from autoshard.models.facts import text_config
from autoshard.models.presets import build_model
from autoshard.passes.capture import fused_patterns
from autoshard.passes.capture import kernels as kernel_table
from autoshard.passes.capture import layer_kinds
from autoshard.passes.capture.capture import BWD, FWD, Captured, Site, capture_model
from autoshard.passes.capture import gated_delta_rule, selective_scan

B_SAMPLES = (2, 3)
PROBE_TOKENS = 1024  # a forward looping over blocks of the sequence shorter than this grows its graph by then
FIELDS = ("flops", "bytes_read", "bytes_written", "saved_bytes", "g0", "g1", "g2", "g3")

# ops that only move or create data: no arithmetic (FLOPs 0), bytes still counted
_DATA_OPS = frozenset({
    "clone", "copy", "copy_", "_to_copy", "cat", "stack", "constant_pad_nd", "embedding", "index",
    "index_select", "gather", "slice_scatter", "select_scatter", "zeros", "zeros_like", "ones",
    "ones_like", "full", "full_like", "new_zeros", "new_ones", "new_full", "new_empty", "empty",
    "empty_like", "empty_strided", "arange", "fill", "fill_", "scalar_tensor", "lift_fresh_copy",
    "masked_fill", "masked_fill_", "where", "repeat", "expand_copy", "contiguous", "tril", "triu",
    "slice_backward", "select_backward", "index_put", "index_put_", "new_empty_strided", "pad",
})
# ops that are views in practice though their schema does not say so
_VIEW_OPS = frozenset({"_unsafe_view", "detach", "alias", "lift_fresh"})
_MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"})
_SCAN_FLOPS = {**selective_scan.SCAN_FLOPS, **gated_delta_rule.FLOPS}  # op name -> FLOPs of its arguments
# ops whose work is one step per element of their first operand (reductions, scatters); every other
# arithmetic op does one step per output element (broadcasting makes the output the largest operand)
_REDUCE_OPS = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "prod", "var", "var_mean", "std", "norm", "linalg_vector_norm",
    "logsumexp", "argmax", "argmin", "any", "all", "embedding_dense_backward", "nll_loss_forward",
    "nll_loss2d_forward", "index_add", "scatter_add", "scatter_reduce", "index_reduce",
})


@dataclass(frozen=True, slots=True, kw_only=True)
class _Measure:
    """One node's numbers at one concrete (b, s)."""

    kind: OpKind
    values: tuple[int, ...]  # in FIELDS order; gemm dims 0 when not a matmul
    gemm: bool




def build(spec: ModelSpec, training: bool, dtype: torch.dtype | str, model: nn.Module | None,
          kernels: tuple[str, ...]) -> CostTable:
    """Trace the 1-layer copy at the sample shapes and interpolate (the work the caches save); `dtype`:
    a torch dtype or its name (`str(torch.bfloat16)`). A model whose layers are of several kinds
    (passes/capture/layer_kinds.py) is traced once per kind: `_mixed`."""
    stack = None if model is None else layer_kinds.find_layer_stack(model)
    if stack is not None and not stack.uniform:
        return _mixed(spec, training, torch_dtype(dtype), model, kernels, stack)
    truncated = _truncated(spec, torch_dtype(dtype), model)
    table = _table_of(spec, truncated, training, kernels)
    return table if stack is None else _grown_outside_layers(table, model, truncated, stack.prefix)


def _mixed(spec: ModelSpec, training: bool, dtype: torch.dtype, model: nn.Module, kernels: tuple[str, ...],
           stack: layer_kinds.LayerStack) -> CostTable:
    """The table of a mixed stack: a LAYER block per kind (named by it, its count and the parameters one
    layer of it owns) from the one-layer copy of that kind; the embedding and head from the copy whose
    embedding computes the most (every mask and rotary table any layer kind asks for)."""
    copies = [layer_kinds.one_layer_copy(model, stack, k.name, dtype) for k in stack.kinds]
    tables = [_table_of(spec, one, training, kernels) for one in copies]
    edges = max(range(len(tables)), key=lambda i: len(tables[i].block(BlockKind.EMBED).nodes))
    grown = _grown_outside_layers(tables[edges], model, copies[edges], stack.prefix)
    layers = tuple(replace(t.block(BlockKind.LAYER), name=k.name, count=k.count, params=k.params)
                   for t, k in zip(tables, stack.kinds))
    return CostTable(model=spec.name, blocks=(grown.block(BlockKind.EMBED), *layers, grown.block(BlockKind.HEAD)),
                     layer_kinds=stack.sequence, shared_params=stack.shared_params)


def _grown_outside_layers(table: CostTable, model: nn.Module, copy: nn.Module, prefix: str) -> CostTable:
    """`table`'s embedding and head, traced on the one-layer `copy`, grown to `model`'s: a parameter outside the
    layers (below `prefix`) that `model` holds `n` times as large as the copy (Gemma-4's per-layer input embedding
    and its projection, [vocab, L x d] and [hidden -> L x d]: every layer reads its own slice) counts in full in
    its block and its module's ops are priced `n` times (as `n` GEMMs of the copy's shape; the projection's add of
    its input's gradient too, under 1% over: tests/passes/capture/test_layer_kinds.py). Not grown: the elementwise
    scaling and the norm of the per-layer inputs outside those modules (priced for one layer's slice).
    The table as it is where nothing grows (every other model)."""
    held = dict(copy.named_parameters())
    grown: dict[str, int] = {}
    extra = 0
    for name, p in model.named_parameters():
        small = held.get(name)
        if small is None or name.startswith(f"{prefix}.") or p.numel() == small.numel():
            continue
        if p.numel() % small.numel():
            return table  # not a multiple of the copy's: the parameter check names it (shapes.check_params)
        grown[name.rpartition(".")[0]] = p.numel() // small.numel()
        extra += p.numel() - small.numel()
    if not grown:
        return table

    def factor(n: NodeCost) -> int:
        return next((f for path, f in grown.items() if n.module_path == path or n.module_path.startswith(f"{path}.")), 1)

    def node(n: NodeCost) -> NodeCost:
        f = factor(n)
        return n if f == 1 else replace(n, flops=f * n.flops, bytes_read=f * n.bytes_read,
                                        bytes_written=f * n.bytes_written, saved_bytes=f * n.saved_bytes,
                                        gemm=None if n.gemm is None else (f * n.gemm[0], *n.gemm[1:]))

    holders = [b for b in table.blocks if b.kind is not BlockKind.LAYER and any(factor(n) > 1 for n in b.nodes)]
    if len(holders) != 1:
        return table  # read by both the embedding and the head, or by neither: the parameter check names the count
    return replace(table, blocks=tuple(
        replace(b, nodes=tuple(map(node, b.nodes)), params=b.params + extra) if b is holders[0] else b
        for b in table.blocks))


def _table_of(spec: ModelSpec, truncated: nn.Module, training: bool, kernels: tuple[str, ...]) -> CostTable:
    """The table of the one-layer model `truncated`, its LAYER block standing for `spec.layers` layers. A forward
    that loops over blocks of the sequence (`_block_loop`) is traced within one block and priced per block."""
    chunk = spec.chunk if spec.mixer is Mixer.SSD else 0
    traced: dict[tuple[int, int], Captured] = {}  # each shape traced once (the block probe's 64 tokens are a sample)

    def trace(b: int, s: int) -> Captured:
        if (b, s) not in traced:
            traced[b, s] = _trace(truncated, b, s, training)
        return traced[b, s]

    block = None if chunk else _block_loop(trace)
    s_samples = (tuple(chunk * k for k in (2, 3, 4)) if chunk else tuple(block * k // 4 for k in (1, 2, 3)) if block
                 else (64, 128, 192))
    traces = {}
    for b in B_SAMPLES:
        for s in s_samples:
            traces[b, s] = trace(b, s)
            if len(traces) == 2:  # a graph that grows with the sequence (RWKV's token loop) refused here, before
                _common_names(traces, spec)  # the longer traces, which take minutes to make
    _common_names(traces, spec)
    measured = {bs: measure(cap, spec, bs, kernels) for bs, cap in traces.items()}
    names = _substituted_names(measured, spec)
    exprs = _interpolate(names, measured, s_samples)
    if chunk:
        odd = (2, 2 * chunk + chunk // 2)
        exprs = _padded_lengths(exprs, names, measure(_trace(truncated, *odd, training), spec, odd, kernels), chunk)
    ref = (B_SAMPLES[0], s_samples[0])
    regions = kernel_table.find_regions(traces[ref], kernels=kernels)
    fused = fused_patterns.find_fused(traces[ref], tokens=ref[0] * ref[1])
    experts = spec.moe_paths[1] if spec.is_moe and len(spec.moe_paths) > 1 else None
    holds = experts is not None and any(n == experts or n.endswith(f".{experts}") for n, _ in truncated.named_modules())
    fused_patterns.check_routing(fused, spec, holds_experts=holds)
    table = _assemble(spec, traces[ref], exprs, measured[ref], truncated, regions, fused)
    return _per_block(table, block) if block else table


def _block_loop(trace: Callable[[int, int], Captured]) -> int | None:
    """The length l of the blocks a forward loops over along the sequence (MiniMax's lightning attention: per block
    of l tokens, (q k^T) v within it and q times the state the blocks before it left), read off the graph: it is the
    same within a block (at l/4 and l/2 tokens) and gains the same nodes with each further block, the first time at
    l + 1 (l a power of two below PROBE_TOKENS). None, at one trace more, where the graph at PROBE_TOKENS is the one
    at 64 tokens (or where it grows some other way: a loop over tokens is refused by `_common_names` as before).
    `trace(b, s)`: the one-layer model's graph at (b, s), memoised by the caller."""

    def size(s: int) -> int:
        return sum(1 for _ in trace(B_SAMPLES[0], s).call_nodes())

    if size(PROBE_TOKENS) == size(64):
        return None
    block = next((p for p in (2 ** k for k in range(4, PROBE_TOKENS.bit_length() - 1)) if size(p + 1) > size(p)), None)
    if block is None:
        return None
    if size(block // 4) != size(block // 2):  # not the same within a block: a loop over tokens (RWKV's), refused after
        return None
    two, three, four = (size(block * n) for n in (2, 3, 4))
    return block if three - two == four - three > 0 else None


def _per_block(table: CostTable, block: int) -> CostTable:
    """`table`, traced within one block of `block` tokens, with its LAYER blocks priced per block: f(b, s) becomes
    f(b s / block, block), each block of a sequence costing what a sequence of one whole block does (its GEMMs
    shaped per block too). Not priced: the gradient a block sends back to the blocks before it, and what HF's Python
    loop adds around the blocks (tests/passes/capture/test_block_loop.py holds it against the graph traced over four
    blocks: FLOPs within 1.5%, bytes within 10%). A sequence shorter than a block is priced as a whole block (its
    within-block (q k^T) v overpriced, by block / s; the layer's projections are per token either way). The
    embedding and head, outside the loop, stay as traced."""
    at = {B: B * S / block, S: sympy.Integer(block)}

    def per(expr):
        return sympy.expand(sympy.sympify(expr).subs(at, simultaneous=True))

    def node(n: NodeCost) -> NodeCost:
        return replace(n, flops=per(n.flops), bytes_read=per(n.bytes_read), bytes_written=per(n.bytes_written),
                       saved_bytes=per(n.saved_bytes), gemm=None if n.gemm is None else tuple(map(per, n.gemm)))

    return replace(table, blocks=tuple(replace(b, nodes=tuple(map(node, b.nodes))) if b.kind is BlockKind.LAYER else b
                                       for b in table.blocks))


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """`torch.bfloat16` for `torch.bfloat16` or its name "torch.bfloat16"."""
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise CaptureError(f"unknown dtype {dtype!r}; give a torch dtype such as torch.bfloat16")
    return value


def measure(cap: Captured, spec: ModelSpec, bs: tuple[int, int], kernels: Sequence[str]) -> dict[str, _Measure]:
    """The numbers of every node of one concrete trace at (b, s) = `bs`, with the regions of the
    fused `kernels` substituted (passes/capture/kernels)."""
    regions = kernel_table.find_regions(cap, kernels=tuple(kernels)) if kernels else ()
    return _measure_graph(cap, regions, spec=spec, bs=bs)


def _substituted_names(measured: dict[tuple[int, int], dict[str, _Measure]], spec: ModelSpec) -> tuple[str, ...]:
    names = {bs: tuple(m) for bs, m in measured.items()}
    first = next(iter(names.values()))
    for bs, these in names.items():
        if these != first:
            raise CaptureError(f"{spec.name}: the fused-kernel regions differ between traced shapes (at {bs}: "
                               f"{sorted(set(these) ^ set(first))[:4]}); report this with the model config")
    return first


def _truncated(spec: ModelSpec, dtype: torch.dtype, model: nn.Module | None) -> nn.Module:
    """The same model with one layer, on the meta device (tracing does not modify it)."""
    if model is None:
        return build_model(replace(spec, layers=1), device="meta", dtype=dtype)
    config = copy.deepcopy(model.config)
    text_config(config).num_hidden_layers = 1  # a multimodal wrapper's decoder (Gemma-3's): its text config's
    with torch.device("meta"):
        return type(model)(config).to(dtype)


def _trace(model: nn.Module, b: int, s: int, training: bool) -> Captured:
    ids = torch.zeros(b, s, dtype=torch.long)
    return capture_model(model, (ids,), joint=training)


def _common_names(traces: dict[tuple[int, int], Captured], spec: ModelSpec) -> tuple[str, ...]:
    """Names of the call nodes; every trace must have the same graph (only shapes differ)."""
    sigs = {bs: [(n.name, str(n.target)) for n in cap.call_nodes()] for bs, cap in traces.items()}
    first_bs, first = next(iter(sigs.items()))
    for bs, sig in sigs.items():
        if sig != first:
            at, diff = next((i, (a, b)) for i, (a, b) in enumerate(zip(first + [None] * len(sig), sig + [None] * len(first)))
                            if a != b)
            where = _module_at(traces[first_bs] if at < len(first) else traces[bs], (first if at < len(first) else sig)[at][0])
            raise CaptureError(
                f"{spec.name}: the traced graph of {where} changes with the input shape (b, s) = {first_bs} vs {bs} "
                f"(first difference: {diff}): its forward loops or branches on the sequence length (e.g. a "
                "selective scan stepped token by token); autoshard needs shape-independent control flow to derive "
                "symbolic costs, so this model cannot be planned (give its mixer a chunked / parallel form)")
    return tuple(name for name, _ in first)


def _module_at(cap: Captured, name: str) -> str:
    """The module (its path) that node `name` of `cap` was recorded in, for a message."""
    site = cap.sites.get(name)
    if site is None or not site.module_path:
        return "the model's top level"
    return f"module {site.module_path}"


# -- measuring one concrete graph -------------------------------------------------------------------

def _val(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _input_tensors(node: fx.Node) -> dict[int, torch.Tensor]:
    """The distinct tensors a node reads (lists flattened, keyword arguments included)."""
    found: dict[int, torch.Tensor] = {}
    for arg in (*node.args, *node.kwargs.values()):
        items = arg if isinstance(arg, (list, tuple)) else (arg,)
        for t in _tensors([_val(a) for a in items]):
            found[id(t)] = t
    return found


def _nbytes(t: torch.Tensor) -> int:
    logical = t.numel() * t.element_size()
    try:
        return min(logical, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return logical


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::", 1)[-1]
    return getattr(target, "__name__", str(target))


def _is_view(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return True  # operator.getitem on a multi-output op
    if _op_name(node) in _VIEW_OPS:
        return True
    returns = target._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _is_attention(name: str) -> bool:
    return "scaled_dot_product" in name or name.endswith(("flash_attention", "efficient_attention",
                                                         "flash_attention_backward",
                                                         "efficient_attention_backward"))


def _attention(node: fx.Node, name: str, args: list) -> tuple[int, tuple[int, int, int, int]]:
    """FLOPs of a fused attention op: full s x s (PaLM convention); backward is 2x forward
    (torch.utils.flop_counter's backward count minus its recomputation of the scores)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    backward = name.endswith("backward")
    q, k, v = (tuple(t.shape) for t in (args[1:4] if backward else args[0:3]))
    b, h, sq, d = q
    gemm = (b * h, sq, k[2], d)
    if not backward:
        return sdpa_flop_count(q, k, v), gemm
    grad_out = tuple(args[0].shape)
    recompute = 2 * b * h * sq * k[2] * d
    return sdpa_backward_flop_count(grad_out, q, k, v) - recompute, gemm


def _matmul(name: str, args: list, out: torch.Tensor) -> tuple[int, tuple[int, int, int, int]]:
    a, w = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
    if a.dim() == 2:
        m, kk = a.shape
        n = w.shape[1]
        return 2 * m * n * kk, (1, m, n, kk)
    batch, m, kk = a.shape
    n = w.shape[-1]
    return 2 * batch * m * n * kk, (batch, m, n, kk)


def _grouped_matmul(args: list, out: torch.Tensor) -> tuple[int, tuple[int, int, int, int]]:
    """`_grouped_mm(a, b, offs)`: every row (or, for a weight gradient, every reduction index) of the
    sorted (token, expert) pairs meets one expert; GEMM shape per expert at an even split."""
    a, b = args[0], args[1]
    groups = args[2].shape[0] if len(args) > 2 and isinstance(args[2], torch.Tensor) else 1
    if a.dim() == 2 and b.dim() == 3:  # (rows, k) x (E, k, n) -> (rows, n)
        rows, kk = a.shape
        n = b.shape[-1]
        return 2 * rows * kk * n, (groups, rows // groups, n, kk)
    if a.dim() == 2 and b.dim() == 2:  # (m, rows) x (rows, n) -> (E, m, n): per-expert weight gradients
        m, rows = a.shape
        n = b.shape[-1]
        return 2 * m * rows * n, (groups, m, n, rows // groups)
    batch, m, kk = a.shape if a.dim() == 3 else (1, *a.shape)
    n = b.shape[-1]
    return 2 * batch * m * kk * n, (batch, m, n, kk)


def _conv(name: str, args: list, out: Any) -> tuple[int, bool]:
    """Convolution FLOPs (torch.utils.flop_counter.conv_flop_count, which is exact for grouped and
    depthwise convolutions through the weight shape); backward counts one forward-sized convolution
    per gradient it computes (input, weight)."""
    from torch.utils.flop_counter import conv_flop_count

    if name == "convolution_backward":
        grad_out, x, w = args[0], args[1], args[2]
        transposed, groups, mask = args[7], args[9], args[10]
        one = conv_flop_count(list(x.shape), list(w.shape), list(grad_out.shape), transposed=transposed)
        return one * sum(bool(m) for m in mask[:2]), groups == 1
    x, w = args[0], args[1]
    transposed, groups = args[6], args[8]
    return conv_flop_count(list(x.shape), list(w.shape), list(out.shape), transposed=transposed), groups == 1


def _measure_node(node: fx.Node) -> _Measure:
    zero = (0,) * len(FIELDS)
    if _is_view(node):
        return _Measure(kind=OpKind.VIEW, values=zero, gemm=False)
    name = _op_name(node)
    args = [_val(a) for a in node.args]
    out = node.meta.get("val")
    ins = _input_tensors(node)
    outs = _tensors(out)
    read = sum(_nbytes(t) for t in ins.values())
    written = sum(t.numel() * t.element_size() for t in outs)
    gemm = (0, 0, 0, 0)
    kind = OpKind.VECTOR
    if _is_attention(name):
        flops, gemm = _attention(node, name, args)
        kind = OpKind.MATMUL
    elif name in _MATMUL_OPS:
        flops, gemm = _matmul(name, args, out)
        kind = OpKind.MATMUL
    elif name == "_grouped_mm":
        flops, gemm = _grouped_matmul(args, out)
        kind = OpKind.MATMUL
    elif name in _SCAN_FLOPS:  # a scan substituted at capture, priced as its kernel (mamba_ssm's, fla's)
        flops = _SCAN_FLOPS[name](args)
    elif name in ("convolution", "convolution_backward"):
        flops, dense = _conv(name, args, out)
        kind = OpKind.MATMUL if dense else OpKind.VECTOR
    elif name in _DATA_OPS:
        flops = 0
    elif name in _REDUCE_OPS:
        flops = next(iter(ins.values())).numel() if ins else 0
    else:
        flops = sum(t.numel() for t in outs)
    return _Measure(kind=kind, values=(flops, read, written, 0, *gemm), gemm=kind is OpKind.MATMUL and any(gemm))


def _saved_bytes(cap: Captured, regions: Sequence[kernel_table.Region] = ()) -> dict[str, int]:
    """Forward outputs the backward reads (through views), by the name of the node that owns the
    storage; a fused kernel's backward reads its inputs instead of its region's internals, and what
    outside ops read from inside a region is charged to the fused node."""
    hidden = {name for r in regions for name in r.bwd}
    fused = {name: r.fwd_name for r in regions for name in r.fwd}
    owners: dict[str, dict[str, int]] = {}

    def note(owner: fx.Node | None) -> None:
        if owner is not None:
            nbytes = sum(_nbytes(t) for t in _tensors(owner.meta.get("val")))
            owners.setdefault(fused.get(owner.name, owner.name), {})[owner.name] = nbytes

    by_name = {n.name: n for n in cap.graph_module.graph.nodes}
    for node in cap.call_nodes():
        if cap.site(node).phase == BWD and node.name not in hidden:
            for arg in node.all_input_nodes:
                note(_storage_owner(arg, cap))
    for region in regions:
        for name in region.inputs:
            note(_storage_owner(by_name[name], cap))
    return {key: sum(parts.values()) for key, parts in owners.items()}


def _storage_owner(node: fx.Node, cap: Captured) -> fx.Node | None:
    """The forward node whose output holds `node`'s storage (through views, and through the outputs
    of a multi-output view op such as split), None for parameters and inputs."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
        if node.target is operator.getitem:
            source = node.args[0]
            if not (source.op == "call_function" and isinstance(source.target, torch._ops.OpOverload)
                    and _is_view(source)):
                break
        elif not _is_view(node):
            break
        node = node.args[0]
    if node.op != "call_function" or cap.site(node).phase != FWD:
        return None  # parameters and inputs are not activations
    return node


def _measure_graph(cap: Captured, regions: Sequence[kernel_table.Region] = (), *, spec: ModelSpec | None = None,
                   bs: tuple[int, int] | None = None) -> dict[str, _Measure]:
    """Every call node's numbers in graph order; each region's nodes replaced by its two fused nodes."""
    start = {r.output: r for r in regions}
    first_bwd: dict[str, kernel_table.Region] = {}
    hidden = set()
    for r in regions:
        hidden |= r.fwd | r.bwd
    order = [n for n in cap.call_nodes()]
    for r in regions:
        first = next((n.name for n in order if n.name in r.bwd), None)
        if first is not None:
            first_bwd[first] = r
    by_name = {n.name: n for n in cap.graph_module.graph.nodes}
    out: dict[str, _Measure] = {}
    for node in order:
        if node.name in start:
            r = start[node.name]
            out[r.fwd_name] = _fused_measure(r, by_name, spec, bs, backward=False)
        if node.name in first_bwd:
            r = first_bwd[node.name]
            out[r.bwd_name] = _fused_measure(r, by_name, spec, bs, backward=True)
        if node.name not in hidden:
            out[node.name] = _measure_node(node)
    states = {r.fwd_name: kernel_table.KERNELS[r.kernel].cost(spec, *bs).state_bytes for r in regions
              if r.bwd}  # a kernel keeps its state only for a backward
    saved = _saved_bytes(cap, regions)
    for name in out:
        nbytes = saved.get(name, 0) + states.get(name, 0)
        if nbytes:
            values = list(out[name].values)
            values[FIELDS.index("saved_bytes")] = nbytes
            out[name] = replace(out[name], values=tuple(values))
    return out


def _fused_measure(region: kernel_table.Region, by_name: dict[str, fx.Node], spec: ModelSpec | None,
                   bs: tuple[int, int] | None, *, backward: bool) -> _Measure:
    """A fused kernel call: its rule's FLOPs; bytes = its inputs, output and state (forward), the
    output gradient, inputs and state read and the input gradients written (backward)."""
    cost = kernel_table.KERNELS[region.kernel].cost(spec, *bs)
    inputs = sum(_nbytes(by_name[n].meta["val"]) for n in (*region.inputs, *region.param_inputs))
    output = sum(t.numel() * t.element_size() for t in _tensors(by_name[region.output].meta.get("val")))
    if backward:
        values = (cost.bwd_flops, output + inputs + cost.state_bytes, inputs, 0)
    else:
        values = (cost.fwd_flops, inputs, output + cost.state_bytes, 0)
    gemm = cost.gemm or (0, 0, 0, 0)
    kind = OpKind.MATMUL if cost.gemm is not None else OpKind.VECTOR
    return _Measure(kind=kind, values=(*values, *gemm), gemm=cost.gemm is not None)


# -- from numbers at sample points to expressions -----------------------------------------------------

def _monomials(b: int, s: int) -> list[int]:
    return [1, s, s * s, b, b * s, b * s * s]


_SYMBOLIC_MONOMIALS = (sympy.Integer(1), S, S**2, B, B * S, B * S**2)


def _solve_matrix(points: Sequence[tuple[int, int]]) -> list[list[Fraction]]:
    """Inverse of the (exact, rational) Vandermonde-like matrix of the monomials at the points."""
    n = len(points)
    rows = [[Fraction(x) for x in _monomials(b, s)] + [Fraction(int(i == j)) for j in range(n)]
            for i, (b, s) in enumerate(points)]
    for col in range(n):
        pivot = next(r for r in range(col, n) if rows[r][col] != 0)
        rows[col], rows[pivot] = rows[pivot], rows[col]
        inv = 1 / rows[col][col]
        rows[col] = [x * inv for x in rows[col]]
        for r in range(n):
            if r != col and rows[r][col] != 0:
                f = rows[r][col]
                rows[r] = [x - f * y for x, y in zip(rows[r], rows[col])]
    return [row[n:] for row in rows]


def _interpolate(names: Sequence[str], measured: dict[tuple[int, int], dict[str, _Measure]],
                 s_samples: Sequence[int]) -> dict[str, tuple[sympy.Expr, ...]]:
    points = [(b, s) for b in B_SAMPLES for s in s_samples]
    inv = _solve_matrix(points)
    exprs: dict[str, tuple[sympy.Expr, ...]] = {}
    for name in names:
        columns = zip(*(measured[p][name].values for p in points))
        exprs[name] = tuple(_poly(inv, col) for col in columns)
    return exprs


def _poly(inv: list[list[Fraction]], values: Sequence[int]) -> sympy.Expr:
    if all(v == values[0] for v in values):
        return sympy.Integer(values[0])
    coeffs = [sum(row[j] * values[j] for j in range(len(values))) for row in inv]
    return sympy.Add(*(sympy.Rational(c.numerator, c.denominator) * m
                       for c, m in zip(coeffs, _SYMBOLIC_MONOMIALS) if c != 0))


def _padded_lengths(exprs: dict[str, tuple[sympy.Expr, ...]], names: Sequence[str],
                    odd: dict[str, _Measure], chunk: int) -> dict[str, tuple[sympy.Expr, ...]]:
    """Re-express the numbers that follow the padded length l*ceiling(s/l) instead of s. The odd-length
    trace's nodes are matched by position when it has as many as the samples (HF's extra un-padding
    slice shifts the names of later slices; a fused kernel hides it), else by name."""
    if len(odd) == len(names):
        odd = dict(zip(names, odd.values()))
    b, s = 2, 2 * chunk + chunk // 2
    padded = chunk * ((s + chunk - 1) // chunk)
    s_pad = chunk * sympy.ceiling(S / chunk)
    out = {}
    for name in names:
        fields = []
        for expr, got in zip(exprs[name], odd[name].values):
            at_s = int(expr.subs({B: b, S: s}))
            if at_s == got:
                fields.append(expr)
            elif int(expr.subs({B: b, S: padded})) == got:
                fields.append(expr.subs(S, s_pad))
            else:  # part per token (s), part per padded token (e.g. the gradient of the un-padding slice)
                per_padded_token = Fraction(got - at_s, b * (padded - s))
                c = sympy.Rational(per_padded_token.numerator, per_padded_token.denominator)
                fields.append(sympy.expand(expr - c * B * S + c * B * s_pad))
        out[name] = tuple(fields)
    return out


# -- blocks ---------------------------------------------------------------------------------------------

def _assemble(spec: ModelSpec, cap: Captured, exprs: dict[str, tuple[sympy.Expr, ...]],
              kinds: dict[str, _Measure], truncated: nn.Module,
              regions: Sequence[kernel_table.Region] = (),
              fused: Sequence[fused_patterns.FusedRegion] = ()) -> CostTable:
    names = list(exprs)
    tags = {name: RegionTag(kernel=r.kernel, key=r.key, size=r.size) for r in fused for name in r.fwd | r.bwd}
    sites = dict(cap.sites)
    targets = {n.name: str(n.target) for n in cap.call_nodes()}
    for r in regions:
        for name, phase in ((r.fwd_name, FWD), (r.bwd_name, BWD)):
            sites[name] = Site(module_path=r.module_path, block=r.block, phase=phase)
            targets[name] = f"autoshard.{r.kernel}" + (".backward" if phase == BWD else "")
    first_layer = next((i for i, n in enumerate(names) if sites[n].block is not None), len(names))
    before = {sites[n].module_path for n in names[:first_layer] if sites[n].phase == FWD}
    groups: dict[BlockKind, list[NodeCost]] = {k: [] for k in BlockKind}
    for i, name in enumerate(names):
        site = sites[name]
        if site.block is not None:
            kind = BlockKind.LAYER
        elif site.phase == FWD:
            kind = BlockKind.EMBED if i < first_layer else BlockKind.HEAD
        else:
            kind = BlockKind.EMBED if site.module_path in before and site.module_path else BlockKind.HEAD
        e = exprs[name]
        m = kinds[name]
        groups[kind].append(NodeCost(
            name=name, target=targets[name],
            kind=m.kind, phase=site.phase, module_path=site.module_path, block=site.block,
            flops=e[0], bytes_read=e[1], bytes_written=e[2], saved_bytes=e[3],
            gemm=(e[4], e[5], e[6], e[7]) if m.gemm else None, region=tags.get(name)))
    params = _block_params(truncated, cap)
    return CostTable(model=spec.name, blocks=tuple(
        BlockCost(name=kind.value, kind=kind, count=spec.layers if kind is BlockKind.LAYER else 1,
                  params=params[kind], nodes=tuple(groups[kind]))
        for kind in (BlockKind.EMBED, BlockKind.LAYER, BlockKind.HEAD)))


def _block_params(model: nn.Module, cap: Captured) -> dict[BlockKind, int]:
    """Parameters of the embedding, of ONE layer, and of the head (a tied LM head counts in EMBED)."""
    out = {k: 0 for k in BlockKind}
    prefixes = tuple(r.prefix + "." for r in cap.repeated)
    placeholders = [n for n in cap.graph_module.graph.nodes if n.op == "placeholder"]
    first_layer = next((i for i, n in enumerate(cap.call_nodes()) if cap.site(n).block is not None), None)
    order = {n.name: i for i, n in enumerate(cap.call_nodes())}
    for (name, p), node in zip(model.named_parameters(), placeholders):
        if name.startswith(prefixes):
            out[BlockKind.LAYER] += p.numel()
            continue
        # a parameter the forward never reads (a multimodal wrapper's vision tower, on text) is held with the embedding
        first_use = min((order[u.name] for u in node.users if u.name in order and cap.site(u).phase == FWD), default=0)
        embed = first_layer is not None and first_use < first_layer
        out[BlockKind.EMBED if embed else BlockKind.HEAD] += p.numel()
    return out

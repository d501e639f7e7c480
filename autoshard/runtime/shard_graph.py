"""Shard a Dynamo FX graph for data and tensor parallelism: the torch.compile backend's rewrite.

Contract: `shard_graph(gm, param_names, program, groups)` returns a new GraphModule computing
this rank's part of the same training step. `param_names` maps placeholder names to original
parameter names (None for data inputs and buffers); `program` is the `ShardProgram` that
`passes.rewrite.shard_program` decided for this tp rank, so the backend and `parallelize` slice
the same parameters the same way. The graph is rewritten at the torch-function level.

The whole contract: docs/modules/runtime.md (runtime/shard_graph.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx as fx
import torch.nn.functional as F

from autoshard.errors import UnsupportedOpError
from autoshard.ir import Replicate, Shard, ShardProgram
from autoshard.runtime.comm import copy_to_group, gather_last_dim, reduce_from_group, split_last_dim
from autoshard.runtime.mesh import Groups

_LINEAR = (F.linear, torch._C._nn.linear)


def local_slice(param: torch.Tensor, placement: Shard) -> torch.Tensor:
    """This rank's slice of every piece of `param` along `placement.dim`, concatenated."""
    pieces = [param.narrow(placement.dim, start, length) for start, length in placement.ranges()]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=placement.dim)


def sharded_param(param: torch.Tensor, placement: Shard, tp_group, dp_group) -> torch.Tensor:
    """Local slice whose gradient arrives full (summed over tp) and summed over dp."""
    return local_slice(copy_to_group(copy_to_group(param, dp_group), tp_group), placement)


def linear_rowwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp_group) -> torch.Tensor:
    """Row-parallel linear: partial products summed over tp, then the (replicated) bias."""
    out = reduce_from_group(F.linear(x, weight), tp_group)
    return out if bias is None else out + bias


def dp_mean(loss: torch.Tensor, dp_group) -> torch.Tensor:
    """Mean of the per-rank losses over dp; the backward scales by 1/dp."""
    size = torch.distributed.get_world_size(dp_group)
    return reduce_from_group(loss, dp_group) / size


def shard_graph(gm: fx.GraphModule, param_names: Mapping[str, str | None], program: ShardProgram,
                groups: Groups) -> fx.GraphModule:
    """Rewrite `gm` for this rank (docs/modules/runtime.md)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placements = dict(program.placements)
    weight_placement: dict[fx.Node, Shard | Replicate] = {}
    # HF's gathered linears (ShardProgram.gather_outputs / split_inputs), by weight: output gathered / input split
    gathered = {**{f"{p}.weight": "gather" for p in program.gather_outputs},
                **{f"{p}.weight": "split" for p in program.split_inputs}}
    styles: dict[fx.Node, str] = {}
    entered: dict[fx.Node, fx.Node] = {}  # input -> its copy_to_group, one per distinct input
    constants: dict[str, object] = {}  # non-tensor arguments live on the module, reached by get_attr

    def constant(name: str, value: object) -> fx.Node:
        constants[name] = value
        return graph.get_attr(name)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        env[node] = graph.node_copy(node, lambda n: env[n])
    tp, dp = constant("_autoshard_tp_group", groups.tp), constant("_autoshard_dp_group", groups.dp)

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            name = param_names.get(node.name)
            if name is not None:
                placement = placements.get(name, Replicate())
                if isinstance(placement, Shard):
                    where = constant(f"_autoshard_placement_{len(constants)}", placement)
                    env[node] = graph.call_function(sharded_param, (env[node], where, tp, dp))
                else:
                    env[node] = graph.call_function(copy_to_group, (env[node], dp))
                weight_placement[node] = placement
                if name in gathered:
                    styles[node] = gathered[name]
        elif node.op == "call_function" and node.target in _LINEAR:
            env[node] = _rewrite_linear(graph, node, env, weight_placement, entered, tp, styles)
        elif node.op == "output":
            outputs = fx.node.map_arg(node.args[0], lambda n: _maybe_loss(graph, n, env[n], dp))
            graph.output(outputs)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    root = torch.nn.Module()
    for name, submodule in gm.named_children():
        root.add_module(name, submodule)
    for name, value in constants.items():
        setattr(root, name, value)
    for node in graph.nodes:  # get_attr of the original graph (buffers, constants) resolve on gm
        if node.op == "get_attr" and node.target not in constants and not hasattr(root, node.target.split(".")[0]):
            setattr(root, node.target.split(".")[0], getattr(gm, node.target.split(".")[0]))
    return fx.GraphModule(root, graph)


def _rewrite_linear(graph, node, env, weight_placement, entered, tp, styles):
    args = list(node.args)
    x = args[0]
    weight = args[1] if len(args) > 1 else node.kwargs["weight"]
    bias = args[2] if len(args) > 2 else node.kwargs.get("bias")
    placement = weight_placement.get(weight) if isinstance(weight, fx.Node) else None
    if not isinstance(placement, Shard):
        return graph.node_copy(node, lambda n: env[n])
    if placement.dim == 0:  # column-parallel
        if x not in entered:
            entered[x] = graph.call_function(copy_to_group, (env[x], tp))
        args = (entered[x], env[weight], env[bias] if isinstance(bias, fx.Node) else bias)
        out = graph.call_function(F.linear, args)
        return graph.call_function(gather_last_dim, (out, tp)) if styles.get(weight) == "gather" else out
    if placement.dim == 1:  # row-parallel
        x_in = graph.call_function(split_last_dim, (env[x], tp)) if styles.get(weight) == "split" else env[x]
        args = (x_in, env[weight], env[bias] if isinstance(bias, fx.Node) else bias, tp)
        return graph.call_function(linear_rowwise, args)
    raise UnsupportedOpError(f"linear {node.name} has a weight sharded on dim {placement.dim}; "
                             "only column (dim 0) and row (dim 1) sharding have a rule")


def _maybe_loss(graph, old: fx.Node, new: fx.Node, dp) -> fx.Node:
    value = old.meta.get("example_value")
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point():
        return graph.call_function(dp_mean, (new, dp))
    return new

"""A forward that loops over blocks of the sequence (MiniMax's lightning attention: per block of 256 tokens, (q k^T) v
within it and q times the state of the blocks before) is traced within one block and priced per block: linear in the
sequence, against the graph HF's loop makes over several blocks. It was traced at 64 / 128 / 192 tokens, inside one
block, and priced quadratic (its 64k-token prefill needed 4.4 TB by the model)."""

import sympy
import torch

from autoshard.commands.common import cost_table_for, model_for
from autoshard.cost_table import B, S
from autoshard.models.tiny import build_tiny, tiny_config
from autoshard.passes.capture import layer_kinds, shapes_trace

FIELDS = ("flops", "bytes_read", "bytes_written", "saved_bytes")
NAME = "tests.passes.capture.test_block_loop:minimax_tiny"


def minimax_tiny():
    return build_tiny(tiny_config("minimax"), device="meta")


def _lightning_layer(model):
    """The one-layer copy of MiniMax's lightning-attention layer kind (bf16, meta), as the table traces it."""
    stack = layer_kinds.find_layer_stack(model)
    return layer_kinds.one_layer_copy(model, stack, "linear_attention", torch.bfloat16)


def _measured(layer, spec, s: int) -> list[int]:
    """The layer's totals (FIELDS) on the graph HF's forward makes at (2, s): s / 256 trips of its block loop."""
    cap = shapes_trace._trace(layer, 2, s, True)
    measured = shapes_trace.measure(cap, spec, (2, s), ())
    sites = dict(cap.sites)
    on = [m.values for name, m in measured.items() if sites[name].block is not None]
    return [sum(v[i] for v in on) for i in range(len(FIELDS))]


def _probed(layer):
    return shapes_trace._block_loop(lambda b, s: shapes_trace._trace(layer, b, s, True))


def test_the_block_length_is_read_off_the_graph_and_a_plain_layer_has_none():
    model = minimax_tiny()
    assert _probed(_lightning_layer(model)) == model.config.block_size == 256
    stack = layer_kinds.find_layer_stack(model)
    full = layer_kinds.one_layer_copy(model, stack, "full_attention", torch.bfloat16)
    assert _probed(full) is None  # attention's graph is the same at every length


def test_a_lightning_layer_is_priced_per_block():
    spec, module = model_for(NAME)
    _, table = cost_table_for(NAME, spinner=False, spec=spec, module=module)
    lightning, full = (next(b for b in table.layer_blocks() if b.name == k) for k in ("linear_attention",
                                                                                       "full_attention"))

    def priced(block, s):
        return [sum(float(sympy.sympify(getattr(n, f)).subs({B: 2, S: s})) for n in block.nodes) for f in FIELDS]

    layer = _lightning_layer(module)
    assert priced(lightning, 256) == _measured(layer, spec, 256)  # one block: the graph as traced
    at = _measured(layer, spec, 1024)  # four blocks: the work per block, and what HF's Python loop adds around it
    flops, read, written, saved = (p / m for p, m in zip(priced(lightning, 1024), at))
    # the FLOPs within 1.5%: not priced, the gradient a block sends back to the blocks before (one (d x d) GEMM per
    # block and head); the bytes within 10%: HF's slicing backward writes a zeroed gradient of the whole sequence per
    # block (quadratic in the sequence in eager; a fused lightning kernel writes none)
    assert 0.985 < flops <= 1 and 0.9 < read <= 1 and 0.9 < written <= 1 and 0.95 < saved <= 1
    # linear in the sequence: each further 16k tokens cost the same (the full-attention layers' cost grows faster)
    for block, linear in ((lightning, True), (full, False)):
        a, b, c = (priced(block, s)[0] for s in (16384, 32768, 49152))
        assert (c - b == b - a) is linear, block.name

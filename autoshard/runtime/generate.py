"""Greedy generation on one replica of a plan: tensor and pipeline parallel, cache kept sharded.

The whole contract: docs/modules/runtime.md (runtime/generate.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autoshard.errors import InvalidConfigError
from autoshard.ir import NON_NEGATIVE_INT
from autoshard.model_spec import Mixer, ModelSpec
from autoshard.models.facts import cache_bytes_by_layer
from autoshard.models.presets import max_positions, position_violation
from autoshard.runtime.comm import gather_last_dim
from autoshard.runtime.stages import OwnForwardStage, StageModule, attention_masks

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def stop_tokens(model: nn.Module) -> tuple[tuple[int, ...], int | None]:
    """(EOS ids, pad id) as HF's greedy `generate` uses them (pad defaults to the first EOS id)."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    eos = () if eos is None else tuple(eos) if isinstance(eos, Sequence) else (int(eos),)
    pad = getattr(config, "pad_token_id", None)
    return eos, (pad if pad is not None else (eos[0] if eos else None))


class Generator:
    """This rank's part of greedy generation (docs/modules/runtime.md)."""

    def __init__(self, model: nn.Module, spec: ModelSpec, chunks: Mapping[int, StageModule],
                 placement: Sequence[int], *, tp_group: dist.ProcessGroup | None,
                 pp_group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.config = model.config
        self.spec = spec
        self.chunks = dict(chunks)  # model chunk index -> this rank's stage module
        self.placement = tuple(placement)  # pp rank of every chunk, in model order
        self.tp_group, self.pp_group = tp_group, pp_group
        self.device = device
        self.pp = dist.get_world_size(pp_group) if pp_group is not None else 1
        self.rank = dist.get_rank(pp_group) if pp_group is not None else 0
        self.eos, self.pad = stop_tokens(model)
        self.cache_bytes = 0  # bytes this rank's cache held at the end of the last generate (checks)

    @torch.no_grad()
    def generate(self, input_ids: Tensor, *, max_new_tokens: int) -> Tensor:
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise InvalidConfigError(f"generate expects integer input_ids of shape (batch, prompt length), got "
                                     f"{input_ids.dtype} {tuple(input_ids.shape)}")
        if not NON_NEGATIVE_INT.ok(max_new_tokens):
            raise InvalidConfigError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        why = position_violation(max_positions(self.spec, self.config), prompt=input_ids.shape[1], new=max_new_tokens)
        if why:
            raise InvalidConfigError(why)
        from transformers import DynamicCache

        ids = input_ids.to(self.device, torch.int64)
        cache = DynamicCache(config=self.config)  # the layers of every chunk this rank holds
        unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=self.device)
        step_input, past, hop_dtypes = ids, 0, {}
        for _ in range(max_new_tokens):
            token = self._step(step_input, cache, past=past, hop_dtypes=hop_dtypes)
            if self.eos:
                token = torch.where(unfinished, token, torch.full_like(token, self.pad))
                unfinished &= ~torch.isin(token, torch.tensor(self.eos, device=self.device))
            past += step_input.shape[1]
            ids = torch.cat([ids, token[:, None]], dim=1)
            step_input = token[:, None]
            if self.eos and not bool(unfinished.any()):
                break
        self.cache_bytes = sum(cache_bytes_by_layer(cache))
        return ids

    def _step(self, ids: Tensor, cache, *, past: int, hop_dtypes: dict[int, torch.dtype]) -> Tensor:
        """One forward of `ids` (b, t) through every chunk in model order; the next token (b,) on
        every rank. `hop_dtypes`: the dtype of the hidden states entering chunk i from another rank,
        learnt from a header at prefill (filled here)."""
        b, t = ids.shape
        x = ids if self.rank == self.placement[0] else None
        for i, owner in enumerate(self.placement):
            prev = self.placement[i - 1] if i else owner
            if prev != owner and self.rank == prev:  # the hidden states hop to the next chunk's rank
                if past == 0:
                    header = torch.tensor([_DTYPES.index(x.dtype)], dtype=torch.int64, device=self.device)
                    dist.send(header, group=self.pp_group, group_dst=owner)
                dist.send(x.contiguous(), group=self.pp_group, group_dst=owner)
            elif prev != owner and self.rank == owner:
                if i not in hop_dtypes:
                    header = torch.empty(1, dtype=torch.int64, device=self.device)
                    dist.recv(header, group=self.pp_group, group_src=prev)
                    hop_dtypes[i] = _DTYPES[int(header)]
                x = torch.empty((b, t, self.spec.hidden), dtype=hop_dtypes[i], device=self.device)
                dist.recv(x, group=self.pp_group, group_src=prev)
            if self.rank == owner:
                x = self._run_stage(self.chunks[i], x, cache, past=past)
        last = self.placement[-1]
        if self.rank == last:
            logits = gather_last_dim(x, self.tp_group)[:, -1].float()  # (b, V)
            token = logits.argmax(dim=-1)
        else:
            token = torch.empty(b, dtype=torch.int64, device=self.device)
        if self.pp > 1:
            dist.broadcast(token, group=self.pp_group, group_src=last)
        return token

    def _run_stage(self, stage: StageModule, x: Tensor, cache, *, past: int) -> Tensor:
        """One chunk's layers on `x` with the cache; hidden states (b, t, h), or the last
        position's logits (b, 1, V / tp) on the last chunk."""
        if isinstance(stage, OwnForwardStage):  # the model's own forward with the cache (its softcaps, scales, ...);
            # over pipeline stages too: each rank's cache holds its own layers, and HF sizes a mask from a layer
            # of its type (tests: Gemma-2's windows on a later stage, Bamba's and Nemotron-H's hybrid caches)
            positions = torch.arange(past, past + x.shape[1], device=x.device)[None]  # (1, t)
            return stage.run(x, cache=cache, logits_to_keep=1, position_ids=positions)
        hidden = stage.embed(x) if stage.embed is not None else x  # (b, t, h)
        if len(stage.layers):
            kwargs = self._layer_kwargs(stage, hidden, cache, past=past)
            for index, layer in stage.layers.items():
                hidden = layer(hidden, **stage.kwargs_of(int(index), kwargs))
        return stage.head(hidden[:, -1:]) if stage.lm_head is not None else hidden

    def _layer_kwargs(self, stage: StageModule, hidden: Tensor, cache, *, past: int) -> dict:
        if self.spec.mixer is not Mixer.ATTENTION:  # SSD blocks: the cache alone (no padding mask)
            return {"cache": cache}
        t = hidden.shape[1]
        position_ids = torch.arange(past, past + t, device=hidden.device)[None]  # (1, t)
        masks = attention_masks(self.config, map(int, stage.layers), inputs_embeds=hidden, attention_mask=None,
                                cache=cache, position_ids=position_ids)
        return {"attention_mask": masks, "position_ids": position_ids, "cache": cache, "use_cache": True,
                "position_embeddings": stage.rotary_emb(hidden, position_ids=position_ids)}

"""vLLM and SGLang launch commands of a serving plan (`InferencePlan`).

The whole contract: docs/modules/engines.md (engines/serving.py).
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass

from autoshard.errors import InvalidConfigError

ENGINES = ("vllm", "sglang")
# vLLM's KV connector for a prefill / decode split (docs/features/disagg_prefill.md of vLLM)
VLLM_KV = {"prefill": {"kv_connector": "P2pNcclConnector", "kv_role": "kv_producer"},
           "decode": {"kv_connector": "P2pNcclConnector", "kv_role": "kv_consumer"}}


@dataclass(frozen=True, slots=True, kw_only=True)
class Launch:
    role: str  # "both" | "prefill" | "decode"
    devices: int  # of one server
    words: tuple[str, ...]  # the command, one word each
    copies: int = 1  # identical servers to launch (replicas of an expert-parallel pool: one server each)

    def text(self) -> str:
        return shlex.join(self.words)


def commands(engine: str, plan, *, model_path: str) -> list[Launch]:
    if engine not in ENGINES:
        raise InvalidConfigError(f"--emit {engine}: serving engines are {', '.join(ENGINES)}")
    context = plan.prompt_len + plan.output_len
    build = _vllm if engine == "vllm" else _sglang
    return [Launch(role=p.role, devices=p.devices // _copies(p), words=tuple(build(p, model_path, context)),
                   copies=_copies(p)) for p in plan.pools]


def _copies(pool) -> int:
    """Servers per pool: one holding every replica as data-parallel ranks, or under expert parallelism (where
    the engines spread the experts over all data-parallel ranks) one server per replica."""
    return pool.replicas if pool.ep > 1 else 1


def _vllm(pool, model_path: str, context: int) -> list[str]:
    dp = pool.ep if pool.ep > 1 else pool.replicas
    out = ["vllm", "serve", model_path, "--tensor-parallel-size", str(pool.tp),
           "--pipeline-parallel-size", str(pool.pp), "--data-parallel-size", str(dp)]
    if pool.ep > 1:
        out.append("--enable-expert-parallel")
    out += ["--max-num-seqs", str(math.ceil(pool.batch / pool.ep)), "--max-model-len", str(context)]
    if pool.role != "both":
        out += ["--kv-transfer-config", json.dumps(VLLM_KV[pool.role], separators=(",", ":"))]
    return out


def _sglang(pool, model_path: str, context: int) -> list[str]:
    out = ["python", "-m", "sglang.launch_server", "--model-path", model_path]
    if pool.ep > 1:
        size = pool.tp * pool.ep
        out += ["--tp-size", str(size), "--ep-size", str(size), "--dp-size", str(pool.ep), "--enable-dp-attention"]
    else:
        out += ["--tp-size", str(pool.tp)]
    out += ["--pp-size", str(pool.pp)]
    if pool.replicas > 1 and pool.ep == 1:
        out += ["--dp-size", str(pool.replicas)]
    out += ["--max-running-requests", str(pool.batch), "--context-length", str(context)]
    if pool.role != "both":
        out += ["--disaggregation-mode", pool.role, "--disaggregation-transfer-backend", "mooncake"]
    return out


def script(engine: str, plan, *, model_path: str) -> str:
    """A shell script: the plan's predicted figures as comments, then one launch per pool."""
    pred = dict(plan.predicted)
    lines = [f"# {plan.model} serving on {plan.devices}x {plan.hardware} with {engine}: prompt {plan.prompt_len}, "
             f"output {plan.output_len} tokens; autoshard predicts TTFT {pred.get('ttft_s', 0) * 1e3:.1f} ms, "
             f"TPOT {pred.get('tpot_s', 0) * 1e3:.2f} ms, {pred.get('throughput_tokens_per_s', 0):.4g} output tokens/s",
             f"# {model_path}: the weights of {plan.model} (a Hugging Face directory or hub id)"]
    launches = commands(engine, plan, model_path=model_path)
    for launch in launches:
        pool = next(p for p in plan.pools if p.role == launch.role)
        lines.append(f"# {launch.role} pool: {pool.replicas} replica(s) of tp{pool.tp} pp{pool.pp}"
                     + (f" ep{pool.ep}" if pool.ep > 1 else "") + f", batch {pool.batch}, {pool.devices} devices")
        if launch.copies > 1:
            lines.append(f"# launch {launch.copies} such servers, {launch.devices} devices each")
        lines.append(launch.text())
    if len(launches) > 1:
        lines.append(f"# put the engine's prefill / decode router in front of both servers ({engine}'s "
                     "disaggregation docs); autoshard priced the KV hand-off, it does not run it")
    return "\n".join(lines) + "\n"

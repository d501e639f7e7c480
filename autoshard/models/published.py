"""Published GPU training runs used to calibrate the GPU device profiles (issue 12).

Three measured runs, with their exact layouts, as the issue hands them for calibration
(/work/shared/reference/gpu_published_runs.json). Each model is an HF `LlamaForCausalLM` config;
the GPT-22B of Korthikanti et al. is written as a LLaMA config whose SwiGLU width 8h/3 has the
parameters and FLOPs of GPT's 4h GELU MLP. The factories are `package.module:factory` names for
the command line: `autoshard sweep --model autoshard.models.published:gpt_22b ...`.

Other published runs (other sizes, device counts and layouts) are held out to check the cost
model blind; they are not here and nothing is fitted to them.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.ir import Fp8Recipe, Mesh, Precision, Recompute
from autoshard.model_spec import Mixer, ModelSpec
from autoshard.models.presets import PRESETS


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishedRun:
    """One measured training step and the layout it ran."""

    id: str
    source: str
    spec: ModelSpec
    hardware: str
    mesh: Mesh
    micro_batch: int
    global_batch: int
    seq_len: int
    zero: int
    recompute: Recompute
    step_s: float  # measured seconds per optimizer step
    schedule: str = "1f1b"  # pipeline schedule (ir.Schedule value)
    virtual_stages: int = 1  # model chunks per pipeline rank (Megatron's VP)
    sequence_parallel: bool = False  # Megatron's sequence parallelism (with tp > 1)
    group: str = "exact"  # "exact": the layout is stated one to one; "approximate": shown, not scored
    precision: Precision = Precision.AUTO  # AUTO: the device's default (bf16-mixed on GPUs); "fp8": FP8 GEMMs
    fp8_recipe: Fp8Recipe | None = None  # fp8 only (tensorwise when None: per-tensor scales, as NeMo's TE runs)


def _llama(name, *, layers, hidden, heads, kv_heads, ffn, vocab) -> ModelSpec:
    return ModelSpec(name=name, mixer=Mixer.ATTENTION, vocab=vocab, hidden=hidden, ffn=ffn, layers=layers,
                     heads=heads, kv_heads=kv_heads, tied=False)


LLAMA31_8B = _llama("llama3.1-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
LLAMA2_13B = _llama("llama2-13b", layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000)
GPT_22B = _llama("gpt-22b", layers=48, hidden=6144, heads=64, kv_heads=64, ffn=16384, vocab=51200)  # 8h/3

CALIBRATION_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(id="llama3.1-8b-h100-cp2", spec=LLAMA31_8B, hardware="h100",
                 source="NVIDIA dgxc-benchmarking, llama3.1 README (v25.04; NeMo / Megatron-Core, bf16, "
                        "distributed optimizer)",
                 mesh=Mesh(dp=4, cp=2), micro_batch=1, global_batch=128, seq_len=8192, zero=1,
                 recompute=Recompute.NONE, step_s=12.27),
    PublishedRun(id="llama2-13b-a100-fsdp64", spec=LLAMA2_13B, hardware="a100-80g",
                 source="torchtitan docs/performance.md (A100-80GB, FSDP, bf16, no activation checkpointing, "
                        "2162 tokens/s/GPU)",
                 mesh=Mesh(dp=64), micro_batch=2, global_batch=128, seq_len=4096, zero=3,
                 recompute=Recompute.NONE, step_s=3.789),
    PublishedRun(id="gpt-22b-a100-tp8", spec=GPT_22B, hardware="a100-80g",
                 source="Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer "
                        "Models, Table 5 (full recompute row)",
                 mesh=Mesh(tp=8), micro_batch=4, global_batch=4, seq_len=2048, zero=1,
                 recompute=Recompute.FULL, step_s=1.42),
)

# FP8 (issue 28): the given row; its bf16 twin is CALIBRATION_RUNS[0] (the same layout, 12.27 s)
FP8_CALIBRATION_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(id="nemo2407-l3-8b-cp2", spec=LLAMA31_8B, hardware="h100",
                 source="NVIDIA/NeMo docs/source/performance/performance_summary.md (NeMo 24.07, commit 070a0bb), "
                        "FP8: 12,036 tokens/s per GPU",
                 mesh=Mesh(dp=4, cp=2), micro_batch=1, global_batch=128, seq_len=8192, zero=1,
                 recompute=Recompute.NONE, step_s=10.89, precision=Precision.FP8),
)


def _build(spec: ModelSpec):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(spec.hf_config())


def llama31_8b():
    """Llama-3.1-8B (HF LlamaForCausalLM, random weights; build under torch.device('meta'))."""
    return _build(LLAMA31_8B)


def llama2_13b():
    """Llama-2-13B."""
    return _build(LLAMA2_13B)


def gpt_22b():
    """GPT-22B of Korthikanti et al. 2022 as a LLaMA config (SwiGLU 8h/3 = GPT's 4h MLP)."""
    return _build(GPT_22B)


# -- serving (issue 29): fixed-batch latency runs of a serving engine --------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class ServingRun:
    """One measured fixed-batch generation: `batch` sequences of `prompt_len` tokens, `output_len` new
    tokens each (end-of-sequence ignored), on one replica of tp GPUs; `total_s` the whole batch's time."""

    id: str
    source: str
    spec: ModelSpec
    hardware: str
    tp: int
    batch: int
    prompt_len: int
    output_len: int
    total_s: float


SERVING_SOURCE = ("argonne-lcf/LLM-Inference-Bench, Plots/All_results.csv: vLLM ~0.5 with CUDA graphs, fp16, "
                  "H100 SXM, fixed prompt / output lengths (issue 29)")
LLAMA3_70B = PRESETS["llama-70b"]  # Llama-3-70B's sizes (its table ships with the package)

SERVING_CALIBRATION: tuple[ServingRun, ...] = (
    ServingRun(id="llama3-8b-h100-tp1-b1", source=SERVING_SOURCE, spec=LLAMA31_8B, hardware="h100", tp=1, batch=1,
               prompt_len=128, output_len=128, total_s=0.994),
    ServingRun(id="llama3-70b-h100-tp4-b1", source=SERVING_SOURCE, spec=LLAMA3_70B, hardware="h100", tp=4, batch=1,
               prompt_len=128, output_len=128, total_s=2.462),
)

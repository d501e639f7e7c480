"""Device profiles: the numbers of one accelerator and the links between accelerators.

Contract: `load_hardware(name_or_path) -> DeviceProfile`. A name picks a built-in profile
(`ascend-910b`, `a100-80g`, `h100`, `h200`, `cpu`); a path to a `.json` file reads a user profile
with the same field names (SI units: FLOP/s, bytes, bytes/s, seconds). Every built-in constant
names its source in `DeviceProfile.sources`; constants calibrated on the paper's measured table
(arXiv 2602.09109, LLaMA-7B on 8x Ascend 910B) say so, with the amount, and are documented in
docs/hardware.md.

Terms: *intra* is the link between devices of one node (HCCS, NVLink); *inter* the per-device
network link between nodes (RoCE, InfiniBand). Bandwidths are per device and per direction: the
rate at which one device can push bytes to its neighbour in a ring.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from autoshard.errors import InvalidConfigError, UnknownNameError
from autoshard.ir import BOOLEAN, NON_NEGATIVE_INT, POSITIVE_INT, is_number, is_positive_number
from autoshard.json_file import load_json

GB = 1e9
MIB = 2**20
TFLOPS = 1e12

# Kernels a device profile may list in `kernels` (their cost rules: passes/cost/fused_regions.py)
KERNEL_NAMES = ("flash_attention", "rmsnorm", "swiglu", "rope",
                "ssd_chunk_scan",  # the Mamba-2 chunked SSD: substituted in the cost table (passes/capture/kernels.py)
                "ssd_chunk_scan_torch")  # the same SSD in torch ops under autograd, as MindSpeed-LLM runs it


# What a training stack's recipe for one kind of sequence mixer runs beyond what a plan states (StackRecipe):
# priced by passes/cost/cost.py `as_stack_runs`
RECIPE_MIXERS = ("attention", "ssd")  # model_spec.Mixer values


@dataclass(frozen=True, slots=True, kw_only=True)
class StackRecipe:
    """The memory settings a device's training stack runs a model of one sequence mixer with (its example
    scripts' flags), which autoshard's own runtime does not run: a plan cannot choose them, the cost model prices
    them for a run of that stack (passes/cost/cost.py `as_stack_runs`, `autoshard price`)."""

    mixer: str  # RECIPE_MIXERS: the models it applies to
    # Megatron `--recompute-granularity full --recompute-method block --recompute-num-layers k`: the first k
    # layers of each model chunk (each pipeline stage without virtual stages) keep only their input and rerun
    # their forward in backward
    recompute_layers: int = 0
    sequence_parallel: bool = False  # `--sequence-parallel` wherever tp > 1
    # MindSpeed `--reuse-fp32-param`: the fp32 master is the bf16 weight plus a 2-byte residual
    reuse_fp32_param: bool = False
    # the fused kernels (KERNEL_NAMES) the stack runs such a model with, in place of the profile's `kernels` (what
    # autoshard's own runtime runs there); None: the profile's. A run of the stack is priced on a cost table built
    # with them (`DeviceProfile.stack_kernels`)
    kernels: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.mixer not in RECIPE_MIXERS:
            raise InvalidConfigError(f"stack recipe: 'mixer' must be one of {', '.join(RECIPE_MIXERS)}, "
                                     f"got {self.mixer!r}")
        NON_NEGATIVE_INT.check("stack recipe 'recompute_layers'", self.recompute_layers)
        for f in ("sequence_parallel", "reuse_fp32_param"):
            BOOLEAN.check(f"stack recipe {f!r}", getattr(self, f))
        if self.kernels is not None:
            if not isinstance(self.kernels, (list, tuple)) or not all(isinstance(k, str) for k in self.kernels):
                raise InvalidConfigError(f"stack recipe {self.mixer!r}: 'kernels' must be a list of kernel names "
                                         f"(or absent: the profile's), got {self.kernels!r}")
            unknown = [k for k in self.kernels if k not in KERNEL_NAMES]
            if unknown:
                raise InvalidConfigError(f"stack recipe {self.mixer!r}: unknown fused kernel(s) {unknown}; "
                                         f"known: {', '.join(KERNEL_NAMES)}")
            object.__setattr__(self, "kernels", tuple(self.kernels))


# Collectives (passes/cost/collectives.Collective values) that may have a log-depth algorithm
LOG_COLLECTIVES = ("reduce", "gather", "all_gather", "reduce_scatter", "all_reduce", "all_to_all")
# NCCL: the double binary tree serves AllReduce only; AllGather / ReduceScatter / Reduce / AllToAll
# run as rings (NCCL docs, NCCL_ALGO; src/graph/tuning.cc: Tree is enabled for ncclFuncAllReduce only)
_NCCL_LOG = ("all_reduce",)
_NCCL_SOURCE = ("NCCL: the double binary tree serves AllReduce only; AllGather, ReduceScatter, Reduce and AllToAll "
                "are rings (NCCL_ALGO docs; src/graph/tuning.cc). NVLS / CollNet (SHARP) and PAT (one GPU per node, "
                "NCCL >= 2.23) not assumed")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceProfile:
    """One accelerator type and its interconnect; all numbers in SI units."""

    name: str
    peak_flops: float  # dense bf16/fp16 GEMM FLOP/s
    memory_bytes: float  # HBM usable by the training process
    hbm_bandwidth: float  # bytes/s
    devices_per_node: int
    intra_bandwidth: float  # bytes/s per device per direction, inside a node
    intra_latency: float  # seconds per message step inside a node
    inter_bandwidth: float  # bytes/s per device per direction, across nodes
    inter_latency: float  # seconds per message step across nodes
    gemm_efficiency: float = 0.8  # achievable fraction of peak_flops for large GEMMs
    gemm_half_dim: float = 64.0  # a GEMM dimension of this size halves that dimension's efficiency factor
    vector_efficiency: float = 0.8  # achievable fraction of hbm_bandwidth for memory-bound ops
    attention_efficiency: float = 0.5  # fused (flash) attention fwd+bwd: achieved fraction of peak_flops
    kernels: tuple[str, ...] = ()  # fused kernels the device runs (KERNEL_NAMES): priced as the kernel, not the traced ops
    # collectives the communication library runs with a log-depth algorithm (tree, recursive
    # doubling / halving) besides the ring (passes/cost/collectives.py `best_time`); the others ring only
    log_collectives: tuple[str, ...] = LOG_COLLECTIVES
    # optimizer offload (plan key offload_optimizer): None = not known, the planner does not offload
    host_link_bandwidth: float | None = None  # bytes/s per device per direction, device <-> host memory
    host_memory_bandwidth: float | None = None  # bytes/s of host DRAM per device (the CPU optimizer step)
    # serving (passes/serving/inference_cost.py): what a decode step costs besides its bytes; None = not known (0)
    ll_base_latency: float | None = None  # s: a low-latency (LL) protocol collective's fixed cost (NCCL baseLat)
    intra_ll_latency: float | None = None  # s per LL step on the intra-node link (NCCL hwLat NVLink / PCI)
    inter_ll_latency: float | None = None  # s per LL step on the network (NCCL hwLat NET)
    kernel_floor_s: float | None = None  # s a kernel of a graph-launched forward costs beyond its bytes / FLOPs
    # tp > 1: eager collectives the serving engine's driver broadcasts a step's inputs to its tp workers with
    step_input_broadcasts: int | None = None
    # FP8 tensor cores (plan precision "fp8", passes/cost/precision.py); None: the device has none, fp8 is refused
    fp8_peak_flops: float | None = None  # dense FP8 (e4m3) GEMM FLOP/s
    fp8_gemm_efficiency: float | None = None  # achievable fraction of fp8_peak_flops for large GEMMs in training
    fp8_gemm_half_dim: float | None = None  # as gemm_half_dim, for the FP8 GEMM tiles
    # the training stack the profile's numbers describe (None: autoshard's own runtime) and what its recipes run
    # per sequence mixer beyond a plan's keys (StackRecipe; none for a mixer: the plan's layout as it is)
    stack: str | None = None
    recipes: tuple[StackRecipe, ...] | None = None
    sources: tuple[tuple[str, str], ...] = ()

    def __hash__(self) -> int:
        # the name alone: equal profiles share it, and the cost model's memo keys (which hold the profile) are
        # hashed at every lookup: the generated hash reads all fields, nested tuples included (1.5 us a time)
        return hash(self.name)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip() or not self.name.isprintable():
            raise InvalidConfigError(f"hardware profile: field 'name' must be a non-empty one-line name (plans, "
                                     f"tables and `autoshard show` print it), got {self.name!r}; e.g. \"my-gpu\"")
        for f in _NUMERIC_FIELDS:
            value = getattr(self, f)
            if not is_positive_number(value):
                raise InvalidConfigError(f"hardware profile {self.name!r}: field {f!r} must be a positive finite "
                                         f"number, got {value!r}")
        why = POSITIVE_INT.violation("field 'devices_per_node'", self.devices_per_node)
        if why:
            raise InvalidConfigError(f"hardware profile {self.name!r}: {why}")
        fp8 = [getattr(self, f) is None for f in _FP8_FIELDS]
        if any(fp8) and not all(fp8):
            raise InvalidConfigError(f"hardware profile {self.name!r}: give all of {', '.join(_FP8_FIELDS)} (a device "
                                     "with FP8 tensor cores) or none of them")
        if self.fp8_gemm_efficiency is not None and not 0 < self.fp8_gemm_efficiency <= 1:
            raise InvalidConfigError(f"hardware profile {self.name!r}: field 'fp8_gemm_efficiency' is a fraction of "
                                     f"fp8_peak_flops and must be in (0, 1], got {self.fp8_gemm_efficiency!r}")
        for f in ("host_link_bandwidth", "host_memory_bandwidth") + SERVING_FIELDS + _FP8_FIELDS:
            value = getattr(self, f)
            zero_ok = f in SERVING_FIELDS  # serving latencies may be 0, bandwidths and peaks not
            if value is not None and not (is_number(value) and (0 <= value if zero_ok else 0 < value)):
                raise InvalidConfigError(f"hardware profile {self.name!r}: field {f!r} must be a "
                                         f"{'non-negative' if f in SERVING_FIELDS else 'positive'} finite "
                                         f"number (or absent), got {value!r}")
        if self.step_input_broadcasts is not None and not NON_NEGATIVE_INT.ok(self.step_input_broadcasts):
            raise InvalidConfigError(f"hardware profile {self.name!r}: field 'step_input_broadcasts' counts the "
                                     f"collectives of a serving step and must be {NON_NEGATIVE_INT.phrase}, got "
                                     f"{self.step_input_broadcasts!r}")
        if not isinstance(self.kernels, (list, tuple)) or not all(isinstance(k, str) for k in self.kernels):
            raise InvalidConfigError(f"hardware profile {self.name!r}: field 'kernels' must be a list of "
                                     f"kernel names, got {self.kernels!r}")
        object.__setattr__(self, "kernels", tuple(self.kernels))
        if not isinstance(self.log_collectives, (list, tuple)) or not all(
                isinstance(c, str) and c in LOG_COLLECTIVES for c in self.log_collectives):
            raise InvalidConfigError(f"hardware profile {self.name!r}: field 'log_collectives' must be a list of "
                                     f"{', '.join(LOG_COLLECTIVES)}, got {self.log_collectives!r}")
        object.__setattr__(self, "log_collectives", tuple(self.log_collectives))
        if self.stack is not None and (not isinstance(self.stack, str) or not self.stack.strip()
                                       or not self.stack.isprintable()):
            raise InvalidConfigError(f"hardware profile {self.name!r}: field 'stack' names the training stack in one "
                                     f"line (absent for autoshard's runtime), got {self.stack!r}")
        if self.recipes is not None and (not isinstance(self.recipes, (list, tuple)) or not all(
                isinstance(r, (dict, StackRecipe)) for r in self.recipes)):
            raise InvalidConfigError(f"hardware profile {self.name!r}: field 'recipes' must be a list of objects "
                                     f"{{mixer, recompute_layers, sequence_parallel, reuse_fp32_param, kernels}}, "
                                     f"got {self.recipes!r}")
        try:
            recipes = tuple(r if isinstance(r, StackRecipe) else StackRecipe(**r) for r in self.recipes or ())
        except TypeError as e:  # an unknown or missing key of a recipe object
            raise InvalidConfigError(f"hardware profile {self.name!r}: field 'recipes': {e}; the keys are mixer, "
                                     "recompute_layers, sequence_parallel, reuse_fp32_param, kernels") from None
        except InvalidConfigError as e:
            raise InvalidConfigError(f"hardware profile {self.name!r}: {e}") from None
        mixers = [r.mixer for r in recipes]
        if len(set(mixers)) < len(mixers):
            raise InvalidConfigError(f"hardware profile {self.name!r}: field 'recipes' gives mixer(s) "
                                     f"{sorted({m for m in mixers if mixers.count(m) > 1})} twice; one recipe each")
        if recipes and not self.stack:
            raise InvalidConfigError(f"hardware profile {self.name!r}: 'recipes' are a training stack's; name it "
                                     "in field 'stack'")
        object.__setattr__(self, "recipes", recipes or None)
        if "cross_entropy" in self.kernels:
            raise InvalidConfigError(f"hardware profile {self.name!r}: 'cross_entropy' is no longer a profile kernel: "
                                     "autoshard's runtime runs its in-place cross-entropy (runtime/loss.py) on every "
                                     "device and prices it so; remove it from 'kernels'")
        unknown = [k for k in self.kernels if k not in KERNEL_NAMES]
        if unknown:
            raise InvalidConfigError(f"hardware profile {self.name!r}: unknown fused kernel(s) {unknown}; "
                                     f"known: {', '.join(KERNEL_NAMES)}")
        for f in ("gemm_efficiency", "vector_efficiency", "attention_efficiency"):
            if getattr(self, f) > 1:
                raise InvalidConfigError(f"hardware profile {self.name!r}: field {f!r} is a fraction of peak and "
                                         f"must be in (0, 1], got {getattr(self, f)!r}")

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / GB

    def fuses(self, kernel: str) -> bool:
        """Whether this device runs `kernel` (a passes/cost/fused_regions.py FUSED_KERNELS name) as one fused op."""
        return kernel in self.kernels

    def source(self, field_name: str) -> str:
        return dict(self.sources).get(field_name, "")

    def recipe(self, mixer: str) -> StackRecipe | None:
        """What the profile's stack runs a model whose layers mix with `mixer` with (None: its plan's layout)."""
        return next((r for r in self.recipes or () if r.mixer == mixer), None)

    def stack_kernels(self, mixer: str) -> tuple[str, ...]:
        """The fused kernels a run of the profile's stack runs a model whose layers mix with `mixer` with: its
        recipe's `kernels`, else the profile's own (what autoshard's runtime runs, which its plans are priced with)."""
        recipe = self.recipe(mixer)
        return self.kernels if recipe is None or recipe.kernels is None else recipe.kernels

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["sources"] = dict(self.sources)
        data["kernels"] = list(self.kernels)
        data["log_collectives"] = list(self.log_collectives)
        data["recipes"] = None if self.recipes is None else [dataclasses.asdict(r) for r in self.recipes]
        return data


SERVING_FIELDS = ("ll_base_latency", "intra_ll_latency", "inter_ll_latency", "kernel_floor_s", "step_input_broadcasts")
_NUMERIC_FIELDS = ("peak_flops", "memory_bytes", "hbm_bandwidth", "devices_per_node", "intra_bandwidth",
                   "intra_latency", "inter_bandwidth", "inter_latency", "gemm_efficiency", "gemm_half_dim",
                   "vector_efficiency", "attention_efficiency")
_FP8_FIELDS = ("fp8_peak_flops", "fp8_gemm_efficiency", "fp8_gemm_half_dim")
_REQUIRED_FIELDS = ("name", "peak_flops", "memory_bytes", "hbm_bandwidth", "devices_per_node", "intra_bandwidth",
                    "intra_latency", "inter_bandwidth", "inter_latency")

_CALIBRATED = "calibrated on arXiv 2602.09109's LLaMA-7B table (8x 910B), see docs/cost_model.md"

ASCEND_910B = DeviceProfile(
    name="ascend-910b",
    peak_flops=378.88 * TFLOPS,
    memory_bytes=60 * GB,
    hbm_bandwidth=1.6e12,
    devices_per_node=8,
    intra_bandwidth=20 * GB,
    intra_latency=20e-6,
    inter_bandwidth=25 * GB,
    inter_latency=20e-6,
    gemm_efficiency=0.9,
    gemm_half_dim=64.0,
    vector_efficiency=0.85,
    kernels=("ssd_chunk_scan",),
    attention_efficiency=0.5,
    stack="MindSpeed-LLM",
    recipes=(StackRecipe(mixer="ssd", recompute_layers=48, sequence_parallel=True, reuse_fp32_param=True,
                         kernels=("ssd_chunk_scan_torch",)),),
    sources=(
        ("peak_flops", "arXiv 2602.09109 case study: 378.88 TFLOPS fp16/bf16 GEMM per 910B"),
        ("memory_bytes", "arXiv 2602.09109: 64 GB HBM, 60 GB usable per device"),
        ("hbm_bandwidth", "Huawei Atlas 800T A2 sheet: HBM2e 1.6 TB/s per 910B"),
        ("devices_per_node", "arXiv 2602.09109: 8x 910B per node (Atlas 800T A2)"),
        ("intra_bandwidth", "HCCS full mesh, 56 GB/s bidirectional per link (Atlas 800T A2 sheet) = 28 GB/s "
                            "per direction; " + _CALIBRATED + ": lowered 28 -> 20 GB/s (HCCL bus bandwidth)"),
        ("intra_latency", "HCCL small-message step latency, order of 10-20 us (Ascend HCCL docs); assumed"),
        ("inter_bandwidth", "Atlas 800T A2: 8x 200GE RoCE, one per NPU = 25 GB/s"),
        ("inter_latency", "RoCE v2 round trip, ~20 us per ring step; assumed"),
        ("gemm_efficiency", _CALIBRATED + ": raised 0.8 -> 0.9 of 378.88 TFLOPS (x0.955 shape factor at 4096^3)"),
        ("gemm_half_dim", "16x16 cube unit plus wave quantisation; 64 (same as the NVIDIA profiles' order)"),
        ("vector_efficiency", _CALIBRATED + ": raised 0.8 -> 0.85 of HBM peak (the HF graph's elementwise ops "
                              "are unfused; MindSpeed fuses them)"),
        ("attention_efficiency", "unused: no fused kernels listed, attention priced as GEMMs (the calibration)"),
        ("log_collectives", "HCCL (CANN collective communication docs): besides the ring, full-mesh inside a node and "
                            "recursive halving-doubling / NHR across nodes for AllReduce, AllGather, ReduceScatter"),
        ("kernels", "ssd_chunk_scan only, what autoshard's runtime runs on torch_npu: runtime/ssd.py's "
                    "memory-efficient scan (torch ops; saves what the fused kernel saves: passes/capture/kernels.py "
                    "ssd_cost; mamba_ssm's Triton kernel is CUDA-only) and HF's gated RMSNorm unfused (the traced "
                    "ops); no LLaMA kernel: the profile was calibrated on the unfused HF graph (docs/hardware.md). "
                    "What MindSpeed-LLM runs there is its recipe's (recipes)"),
        ("stack", "arXiv 2602.09109 ran its 910B tables on MindSpeed-LLM; the profile's numbers describe that stack"),
        ("recipes", "MindSpeed-LLM's Mamba-2 recipe (examples/mcore/mamba2/pretrain_mamba2_2.7b_4k_ptd.sh at "
                    "3b457672, the parent of f35bfccc which removed it; 64 layers, the mamba2-7b preset's count): "
                    "--recompute-granularity full --recompute-method block --recompute-num-layers 48 (MindSpeed "
                    "_mamba_block_method_checkpointed_forward_func: the first 48 layers of each pipeline stage), "
                    "--sequence-parallel, --use-distributed-optimizer --reuse-fp32-param (MindSpeed "
                    "docs/zh/features/reuse-fp32-param.md: FP32 = BF16 + residual, saves sizeof(bf16) x params / "
                    "DP under the distributed optimizer; every Mamba-2 recipe and CI script runs it). Its kernels: "
                    "ssd_chunk_scan_torch, no fused SSD on Ascend: mindspeed_llm/core/ssm/mamba_mixer.py (3b457672) "
                    "patches mamba_ssm's kernels with dummies and runs StateSpaceProcessor "
                    "(tasks/models/ssm/state_space_duality.py), the chunked SSD in torch ops under autograd "
                    "(passes/capture/kernels.py ssd_torch_cost), and no gated-norm kernel: mamba_mixer_init_wrapper "
                    "builds the mixer with rmsnorm=False (not mamba_ssm's Triton RMSNormGated) and adds its own "
                    "Mamba2RMSNorm in torch ops (the traced HF ops' price). No attention recipe: the LLaMA-2-7B script runs neither recompute nor the "
                    "reused copy (the calibration)"),
    ),
)

# NVIDIA profiles: peak and bandwidth from the datasheets; achievable GEMM throughput from a public
# microbenchmark (MAMF, the maximum achievable matmul FLOPS over large shapes, ml-engineering
# compute/accelerator/README.md: A100 SXM 267.9 of 312 TFLOPS = 85.9%, H100 SXM 792.1 of 989 = 80.1%,
# best shapes 6912x16384x2048 and 6144x17920x2816); capacity from what nvidia-smi reports, less the
# CUDA context and NCCL / cuBLAS workspaces. `gemm_efficiency` is the MAMF share divided by the
# shape factor at the MAMF best shape (so the model gives the MAMF there), see docs/hardware.md.
# flash attention (FA2 / FA3 / cuDNN), TE / Apex fused RMSNorm, SwiGLU, RoPE, Mamba-2 SSD (mamba_ssm's)
_GPU_FUSED = ("flash_attention", "rmsnorm", "swiglu", "rope", "ssd_chunk_scan")
_FUSED_SOURCE = ("Megatron-Core / Transformer Engine production runs: fused RMSNorm (TE), bias-SwiGLU "
                 "fusion, fused RoPE, flash / cuDNN fused attention, priced in "
                 "passes/cost/fused_regions.py; the Mamba-2 SSD as mamba_ssm's "
                 "mamba_chunk_scan_combined (passes/capture/kernels.py). autoshard's runtime runs the element-wise "
                 "fusions through compiled layers (runtime/compiled.py) and mamba_ssm's SSD where it is installed; "
                 "without it its own SSD (runtime/ssd.py, torch ops) saves what the fused kernel saves but ran "
                 "4-6x slower than this price on an H200 (docs/cost_model.md, 'Measured on an H200'). No Mamba-2 "
                 "gated-norm kernel: the runtime runs the model's own gated norm (HF's torch ops; Mamba-2 layers "
                 "are not compiled), not mamba_ssm's Triton RMSNormGated, so it is priced as traced "
                 "(docs/kernels.md)")
# Serving: NCCL's low-latency protocol (src/graph/tuning.cc, NCCL 2.18-2.27: baseLat Ring/LL 6.6 us; hwLat
# Ring/LL per step: NVLink 0.6 us, PCI 1.0 us, NET 2.7 us) and the per-kernel floor of a CUDA-graph decode step
_LL = dict(ll_base_latency=6.6e-6, intra_ll_latency=0.6e-6, inter_ll_latency=2.7e-6)
_LL_SOURCE = ("NCCL src/graph/tuning.cc (2.18-2.27): LL protocol baseLat (Ring) 6.6 us; hwLat per step, Ring/LL: "
              "NVLink 0.6 us (PCI 1.0 us for PCIe cards), NET 2.7 us; the LL payload is half the link bandwidth")
KERNEL_FLOOR = 5.2e-6
_FLOOR_SOURCE = ("calibrated on issue 29's two given vLLM rows (Llama-3-8B 1 H100 tp1 b1 128/128 0.994 s, "
                 "Llama-3-70B 4 H100 tp4 b1 2.462 s; the two solve to 5.5 and 4.8 us with the input broadcast priced; 5.2 keeps both within 2%, docs/inference.md): the time a decode "
                 "kernel costs beyond its bytes under CUDA graphs (graph node launch, the DRAM-latency ramp and the "
                 "tail of a GEMV that streams a few MB, 12 kernels per LLaMA layer); no per-step host term is "
                 "needed for those rows")
# vLLM 0.5.x, the engine of issue 29's rows (argonne-lcf/LLM-Inference-Bench vLLM/H100/benchmark_latency.py is
# v0.5.1-0.5.3's): every step the driver broadcasts the step's inputs to its tp workers, one NCCL broadcast per tensor
STEP_INPUT_BROADCASTS = 9
_STEP_INPUT_SOURCE = (
    "vLLM 0.5.x (v0.5.1-0.5.3, the engine of issue 29's rows): each step the driver worker "
    "(worker/worker_base.py LocalOrDistributedWorkerBase.execute_model) calls broadcast_tensor_dict "
    "(distributed/parallel_state.py): the metadata list through the shared-memory MessageQueue (PR #5399; a host "
    "memcpy, not priced), then one torch.distributed.broadcast over the tp device group (NCCL, eager: outside the "
    "CUDA graph, serialised on the NCCL stream ahead of the graph on every rank) per non-empty GPU tensor of the "
    "model input: input_tokens, input_positions, selected_token_indices (SamplingMetadata) and slot_mapping, "
    "seq_lens_tensor, context_lens_tensor, block_tables, query_start_loc, seq_start_loc (FlashAttentionMetadata) "
    "= 9; each priced by the collective model (a ring broadcast under NCCL's LL protocol, ~7-9 us on NVLink). "
    "0 for an engine whose ranks each build their own inputs (SGLang's tp workers)")
_RESERVE = 2 * GB  # CUDA context (~0.5-1 GB) + NCCL channel buffers and cuBLAS workspaces (~1 GB)
_RESERVE_SOURCE = "; less 2 GB for the CUDA context (~0.5-1 GB) and NCCL / cuBLAS workspaces"

A100_80G = DeviceProfile(
    name="a100-80g",
    peak_flops=312 * TFLOPS,
    memory_bytes=81920 * MIB - _RESERVE,
    hbm_bandwidth=2.039e12,
    devices_per_node=8,
    intra_bandwidth=240 * GB,
    intra_latency=10e-6,
    inter_bandwidth=25 * GB,
    inter_latency=15e-6,
    gemm_efficiency=0.63,
    gemm_half_dim=128.0,
    vector_efficiency=0.8,
    attention_efficiency=0.58,
    kernels=_GPU_FUSED,
    log_collectives=_NCCL_LOG,
    **_LL,
    kernel_floor_s=KERNEL_FLOOR,
    step_input_broadcasts=STEP_INPUT_BROADCASTS,
    host_link_bandwidth=32 * GB,
    host_memory_bandwidth=51.2 * GB,
    sources=(
        ("ll_base_latency", _LL_SOURCE), ("intra_ll_latency", _LL_SOURCE), ("inter_ll_latency", _LL_SOURCE),
        ("kernel_floor_s", "as h100 (" + _FLOOR_SOURCE + "); not measured on A100"),
        ("step_input_broadcasts", _STEP_INPUT_SOURCE),
        ("host_link_bandwidth", "NVIDIA A100 datasheet: PCIe Gen4 x16, 64 GB/s bidirectional = 32 GB/s per direction"),
        ("host_memory_bandwidth", "DGX A100 user guide: 2x AMD EPYC 7742, 8 channels DDR4-3200 each = 2 x 204.8 "
                                  "GB/s, shared by 8 GPUs = 51.2 GB/s per GPU"),
        ("peak_flops", "NVIDIA A100 datasheet: 312 TFLOPS dense BF16 tensor core (TF32: 156, half)"),
        ("memory_bytes", "A100-SXM4-80GB: nvidia-smi reports 81920 MiB" + _RESERVE_SOURCE),
        ("hbm_bandwidth", "NVIDIA A100 80GB SXM datasheet: 2,039 GB/s"),
        ("devices_per_node", "DGX A100: 8 GPUs per node"),
        ("intra_bandwidth", "NVLink 3: 600 GB/s bidirectional = 300 GB/s per direction; NCCL busbw ~240 GB/s "
                            "(nccl-tests on DGX A100)"),
        ("intra_latency", "NCCL ring step latency over NVLink, ~5-10 us (nccl-tests); assumed 10 us"),
        ("inter_bandwidth", "DGX A100: 8x HDR InfiniBand 200 Gb/s, one per GPU = 25 GB/s (rail-optimised: "
                            "a ring uses one NIC per member GPU of a node, passes/cost/collectives.py)"),
        ("inter_latency", "InfiniBand HDR ring step, ~15 us incl. NCCL proxy; assumed"),
        ("gemm_efficiency", "calibrated on issue 12's two A100 rows (llama2-13b FSDP64, gpt-22b TP8: both "
                            "within 1% at 0.63, docs/hardware.md): sustained GEMM share in training. Upper bound: "
                            "MAMF 267.9 / 312 = 85.9% at 6912x16384x2048 (ml-engineering compute/accelerator, "
                            "an isolated matmul) = 0.937 after the shape factor there (0.917)"),
        ("gemm_half_dim", "CTA tiles of 128 (cuBLAS / CUTLASS 128x128 and 256x128 on SM80): a dimension of "
                          "d loses about half a tile plus the k-loop prologue, d / (d + 128)"),
        ("vector_efficiency", "STREAM-like fraction of HBM peak; assumed 0.8"),
        ("attention_efficiency", "FlashAttention-2 (Dao 2023, fig. 4-5): causal fwd+bwd, head dim 128, seq "
                                 "2k-16k on A100 reaches 160-190 TFLOPS (FLOPs counted as flash does: causal "
                                 "half, backward 2.5x forward) = 0.51-0.61 of 312; 0.58"),
        ("kernels", _FUSED_SOURCE),
        ("log_collectives", _NCCL_SOURCE),
    ),
)

H100 = DeviceProfile(
    name="h100",
    peak_flops=989 * TFLOPS,
    memory_bytes=81559 * MIB - _RESERVE,
    hbm_bandwidth=3.35e12,
    devices_per_node=8,
    intra_bandwidth=360 * GB,
    intra_latency=8e-6,
    inter_bandwidth=50 * GB,
    inter_latency=12e-6,
    gemm_efficiency=0.75,
    gemm_half_dim=128.0,
    vector_efficiency=0.8,
    attention_efficiency=0.53,
    kernels=_GPU_FUSED,
    log_collectives=_NCCL_LOG,
    **_LL,
    kernel_floor_s=KERNEL_FLOOR,
    step_input_broadcasts=STEP_INPUT_BROADCASTS,
    host_link_bandwidth=64 * GB,
    host_memory_bandwidth=76.8 * GB,
    fp8_peak_flops=1979 * TFLOPS,
    fp8_gemm_efficiency=0.75 * 1.75 / 2,
    fp8_gemm_half_dim=256.0,
    sources=(
        ("ll_base_latency", _LL_SOURCE), ("intra_ll_latency", _LL_SOURCE), ("inter_ll_latency", _LL_SOURCE),
        ("kernel_floor_s", _FLOOR_SOURCE), ("step_input_broadcasts", _STEP_INPUT_SOURCE),
        ("fp8_peak_flops", "NVIDIA H100 SXM datasheet: 3,958 TFLOPS FP8 with sparsity = 1,979 dense, twice the BF16 "
                           "peak (H200 the same die)"),
        ("fp8_gemm_efficiency", "derived, not fitted: gemm_efficiency (0.75 of the BF16 peak, sustained in training) "
                                "x the FP8 / BF16 speed-up of large matmuls on Hopper, 1.75x (NVIDIA blog 'Boosting "
                                "Matrix Multiplication Speed and Flexibility with NVIDIA cuBLAS 12.9', channel- and "
                                "block-scaled FP8 on H100) / the peak ratio 2 = 0.656 of 1,979 TFLOPS"),
        ("fp8_gemm_half_dim", "SM90 FP8 GEMM tiles step K by 128 elements where BF16's step 64 (CUTLASS sm90 FP8 "
                              "kernels, 128x128x128 / 128x256x128 tiles): d / (d + 256). Check: at 1024^3 this gives "
                              "FP8 / BF16 = 2 x 0.875 x 0.512 / 0.702 = 1.28x, the same blog's 'at least 1.25x for "
                              "most other cases'"),
        ("host_link_bandwidth", "NVIDIA H100 SXM datasheet: PCIe Gen5 x16, 128 GB/s bidirectional = 64 GB/s per "
                                "direction (H200 the same)"),
        ("host_memory_bandwidth", "DGX H100 user guide: 2x Intel Xeon Platinum 8480C, 8 channels DDR5-4800 each = "
                                  "2 x 307.2 GB/s, shared by 8 GPUs = 76.8 GB/s per GPU (DGX H200 the same)"),
        ("peak_flops", "NVIDIA H100 SXM datasheet: 989 TFLOPS dense BF16 (1,979 with sparsity; TF32 494, half)"),
        ("memory_bytes", "H100 80GB HBM3 (SXM): nvidia-smi reports 81559 MiB" + _RESERVE_SOURCE),
        ("hbm_bandwidth", "NVIDIA H100 SXM datasheet: 3.35 TB/s"),
        ("devices_per_node", "DGX H100 / HGX H100: 8 GPUs per node"),
        ("intra_bandwidth", "NVLink 4: 900 GB/s bidirectional = 450 GB/s per direction; NCCL busbw ~360 GB/s"),
        ("intra_latency", "NCCL ring step latency over NVLink, assumed 8 us"),
        ("inter_bandwidth", "DGX H100: 8x ConnectX-7 NDR 400 Gb/s, one per GPU = 50 GB/s (rail-optimised, see "
                            "a100-80g)"),
        ("inter_latency", "InfiniBand NDR ring step, assumed 12 us"),
        ("gemm_efficiency", "calibrated on issue 12's H100 row (llama3.1-8b, CP2 DP4): sustained GEMM share "
                            "in training, 0.75. Upper bound: MAMF 792.1 / 989 = 80.1% at 6144x17920x2816 "
                            "(ml-engineering compute/accelerator, an isolated matmul) = 0.861 after the shape "
                            "factor there (0.930)"),
        ("gemm_half_dim", "CTA tiles of 128 (cuBLAS / CUTLASS 128x128 and 128x256 on SM90); as a100-80g"),
        ("vector_efficiency", "STREAM-like fraction of HBM peak; assumed 0.8"),
        ("attention_efficiency", "FlashAttention-3 (Shah et al. 2024) / cuDNN fused attention on H100, causal, "
                                 "head dim 128: forward ~640 TFLOPS (0.65), backward ~500 (0.5, 1.5-1.75x "
                                 "FA2's); weighted 1 : 2.5 as flash counts them = 0.53. torch SDPA's FA2 "
                                 "backend reaches ~0.35 on H100 (FA3 paper, fig. 5)"),
        ("kernels", _FUSED_SOURCE),
        ("log_collectives", _NCCL_SOURCE),
    ),
)

H200 = dataclasses.replace(
    H100,
    name="h200",
    memory_bytes=143771 * MIB - _RESERVE,
    hbm_bandwidth=4.8e12,
    sources=tuple(
        (k, v) for k, v in H100.sources if k not in ("memory_bytes", "hbm_bandwidth", "peak_flops")
    ) + (
        ("peak_flops", "NVIDIA H200 SXM datasheet: 989 TFLOPS dense BF16 (same die as H100)"),
        ("memory_bytes", "H200 141 GB HBM3e: nvidia-smi reports 143771 MiB" + _RESERVE_SOURCE),
        ("hbm_bandwidth", "NVIDIA H200 datasheet: 4.8 TB/s"),
    ),
)

CPU = DeviceProfile(
    name="cpu",
    peak_flops=1 * TFLOPS,
    memory_bytes=16 * GB,
    hbm_bandwidth=20 * GB,
    devices_per_node=64,
    intra_bandwidth=5 * GB,
    intra_latency=50e-6,
    inter_bandwidth=1.25 * GB,
    inter_latency=100e-6,
    gemm_efficiency=0.5,
    gemm_half_dim=32.0,
    vector_efficiency=0.5,
    attention_efficiency=0.5,
    kernels=("ssd_chunk_scan",),
    host_link_bandwidth=20 * GB,
    host_memory_bandwidth=20 * GB,
    sources=(
        ("host_link_bandwidth", "the device memory is host memory: an offload copy runs at DRAM speed (as hbm_bandwidth)"),
        ("host_memory_bandwidth", "as hbm_bandwidth (the same DRAM)"),
        ("peak_flops", "order of a many-core AVX-512 server socket in fp32 (~1 TFLOPS); a stand-in for gloo runs"),
        ("memory_bytes", "assumed 16 GB per process"),
        ("hbm_bandwidth", "DDR4/DDR5 bandwidth available to one process, ~20 GB/s; assumed"),
        ("devices_per_node", "gloo processes on one host share memory; assumed 64 per host"),
        ("intra_bandwidth", "gloo over loopback TCP / shared memory, ~5 GB/s; assumed"),
        ("intra_latency", "gloo loopback message latency ~50 us; assumed"),
        ("inter_bandwidth", "10 GbE = 1.25 GB/s"),
        ("inter_latency", "TCP over Ethernet ~100 us; assumed"),
        ("gemm_efficiency", "oneDNN/MKL sgemm ~50% of peak; assumed"),
        ("gemm_half_dim", "small register blocking; assumed 32"),
        ("vector_efficiency", "assumed 0.5"),
        ("attention_efficiency", "SDPA on CPU (flash_attention_for_cpu): assumed as gemm_efficiency, 0.5"),
        ("log_collectives", "gloo: ring and recursive-doubling / bcube algorithms (gloo/allreduce_bcube.h, "
                            "allgather); every collective, the model's default"),
        ("kernels", "ssd_chunk_scan only: autoshard runtime/ssd.py (torch ops; saves what the fused kernel "
                    "saves); otherwise gloo runs of the HF model, unfused"),
    ),
)

PROFILES: Mapping[str, DeviceProfile] = {p.name: p for p in (ASCEND_910B, A100_80G, H100, H200, CPU)}


def hardware_names() -> tuple[str, ...]:
    return tuple(PROFILES)


def load_hardware(name_or_path: str | Path | DeviceProfile) -> DeviceProfile:
    """A built-in profile by name, or a JSON profile file (same field names, SI units)."""
    if isinstance(name_or_path, DeviceProfile):
        return name_or_path
    text = str(name_or_path)
    if text in PROFILES:
        return PROFILES[text]
    path = Path(text)
    if text.endswith(".json") or path.is_file():
        return _load_profile_file(path)
    raise UnknownNameError(f"unknown hardware {text!r}; known profiles: {', '.join(PROFILES)} "
                           "(or pass a path to a JSON profile, see docs/hardware.md)")


def _load_profile_file(path: Path) -> DeviceProfile:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InvalidConfigError(f"cannot read hardware profile {path}: {e.strerror}") from None
    data = load_json(raw, source=f"hardware profile {path}")
    if not isinstance(data, dict):
        raise InvalidConfigError(f"hardware profile {path}: expected a JSON object of fields, "
                                 f"found {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(DeviceProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InvalidConfigError(f"hardware profile {path}: unknown field(s) {unknown}; "
                                 f"known fields: {', '.join(sorted(known))}")
    missing = [f for f in _REQUIRED_FIELDS if f not in data]
    if missing:
        raise InvalidConfigError(f"hardware profile {path}: missing field(s) {missing}; "
                                 f"required: {', '.join(_REQUIRED_FIELDS)} (SI units, see docs/hardware.md)")
    sources = data.get("sources", {})
    if not isinstance(sources, dict):
        raise InvalidConfigError(f"hardware profile {path}: field 'sources' must be an object {{field: source}}")
    fields = {k: v for k, v in data.items() if k != "sources"}
    try:
        return DeviceProfile(**fields, sources=tuple((str(k), str(v)) for k, v in sources.items()))
    except InvalidConfigError as e:
        raise InvalidConfigError(f"{path}: {e}") from None

"""autoshard's runtime measured on one accelerator against the cost model's prediction for it.

Two halves, so the device time is spent on measuring alone:

    python bench/bench_device.py --measure --out measured.json      # on a CUDA machine (a world of one)
    python bench/bench_device.py --report measured.json             # anywhere: joins estimate() to it

`--measure` runs every configuration of CONFIGS (HF LlamaForCausalLM / Mamba2ForCausalLM presets,
random weights, built on the device) through `autoshard.parallelize(..., plan=...)` with AdamW, one
training step = `dm.train_step` (forward + backward of every micro-batch, the optimizer step).
Eager configurations pass `compile=False`; "compiled" ones `compile=True` (runtime/compiled.py: the
decoder layers under Inductor, whose fused element-wise kernels the GPU profiles price; the default
on CUDA for dense LLaMA models).
Per configuration: `--warmup` steps, then `--steps` timed steps (CUDA synchronised around each), the
median step time and the peak of `torch.cuda.max_memory_allocated` over the timed steps (the peak
counters are reset after the warm-up), each configuration in a process of its own. A configuration
that runs out of memory is recorded as such. `--budget-s` stops before a configuration that might
not finish in time; results are written after each one.

`--report` prices each configuration with `estimate()` for the measured device's profile
(h100/h200/a100-80g, read off the device name) and prints measured vs predicted step time and
memory, their ratio, and how well the predictions rank the measured configurations (the fraction
of pairs of the same model whose order the prediction gets right).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from itertools import combinations
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


RESULT = "RESULT "


@dataclass(frozen=True)
class Config:
    model: str
    seq: int
    global_batch: int
    micro_batch: int
    recompute: str = "none"
    compiled: bool = False

    @property
    def name(self) -> str:
        return (f"{self.model} s{self.seq} gb{self.global_batch} mb{self.micro_batch} {self.recompute}"
                f"{' compiled' if self.compiled else ''}")


CONFIGS = (  # in order of what matters most, in case the device time runs out
    # Mamba-2 1.3B: its SSD through mamba_ssm's fused kernel where installed (runtime/ssd.py fused_scan)
    Config("mamba2-1b", 2048, 8, 1),
    Config("mamba2-1b", 2048, 8, 4),
    # TinyLlama-shaped 1.1B, decoder layers compiled (the CUDA default): micro-batch sweep at a fixed batch
    Config("llama-1b", 2048, 16, 4, compiled=True),
    Config("llama-1b", 2048, 16, 1, compiled=True),
    # LLaMA-7B: 16 B of state per parameter (108 GB) leaves room for full recompute only
    Config("llama-7b", 2048, 4, 1, "full", compiled=True),
    Config("mamba2-1b", 2048, 8, 4, "full"),
    Config("llama-1b", 2048, 16, 2, compiled=True),
    Config("llama-1b", 2048, 16, 4, "full", compiled=True),
    Config("llama-1b", 2048, 16, 8, compiled=True),
    Config("mamba2-1b", 2048, 8, 2),
    # eager HF layers (compile=False)
    Config("llama-1b", 2048, 16, 4),
    Config("llama-1b", 2048, 16, 1),
    Config("llama-1b", 2048, 16, 4, "selective"),
    Config("llama-1b", 2048, 16, 4, "full"),
)


SMOKE_CONFIGS = (
    Config("llama-tiny", 64, 4, 2),
    Config("llama-tiny", 64, 4, 2, "full"),
    Config("mamba2-tiny", 64, 4, 2, "selective"),
    Config("llama-tiny", 64, 4, 2, compiled=True),
)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_one(cfg: Config, *, warmup: int, steps: int, device: str = "cuda:0", fused_adamw: bool = False,
                profile: bool = False) -> dict:
    import autoshard
    from autoshard.models.presets import build_model, get_spec

    spec = get_spec(cfg.model)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.init()
        torch.cuda.set_device(device)
    model = build_model(spec, device=device, seed=0)
    gen = torch.Generator(device="cpu").manual_seed(0)
    batches = [torch.randint(0, spec.vocab, (cfg.global_batch, cfg.seq), generator=gen) for _ in range(2)]
    plan = dict(micro_batch=cfg.micro_batch, recompute=cfg.recompute, precision="bf16-mixed")
    adamw = functools.partial(torch.optim.AdamW, lr=1e-5, **({"fused": True} if fused_adamw else {}))
    dm = autoshard.parallelize(model, batches[0], plan=plan, global_batch=cfg.global_batch, optimizer=adamw,
                               device=device, hardware="h200" if cuda else "cpu",
                               compile=(True if cuda else "aot_eager") if cfg.compiled else False)
    times, profiled = [], {}
    for i in range(warmup + steps + int(profile)):
        if i == warmup and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        ids = batches[i % 2].to(device)
        _sync(device)
        t0 = time.perf_counter()
        if profile and i == warmup:
            activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
            with torch.profiler.profile(activities=[activity]) as prof:
                loss = dm.train_step(ids, ids)
                _sync(device)
            kernels = prof.key_averages().table(sort_by=f"{'cuda' if cuda else 'cpu'}_time_total", row_limit=15)
            print(kernels, flush=True)
            profiled = _kernel_totals(prof, cuda, time.perf_counter() - t0)
            continue
        loss = dm.train_step(ids, ids)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    out = dict(step_s=statistics.median(times), steps_s=times, loss=float(loss), **profiled)
    if cuda:
        out.update(peak_bytes=torch.cuda.max_memory_allocated(), reserved_bytes=torch.cuda.max_memory_reserved())
    return out


def _kernel_totals(prof, cuda: bool, wall_s: float) -> dict:
    """The profiled step's device kernels: how many, their summed time, and the step's wall time under
    the profiler (the gap is time the device waited on the host)."""
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    kernels = [e for e in prof.events() if e.device_type == kind]
    return dict(profiled_kernels=len(kernels), profiled_busy_s=sum(e.time_range.elapsed_us() for e in kernels) / 1e6,
                profiled_step_s=wall_s)


def measure(args) -> None:
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        sys.exit("--measure needs a CUDA device (--smoke runs tiny presets on the CPU to check this script)")
    device = "cpu" if smoke else "cuda:0"
    configs = SMOKE_CONFIGS if smoke else CONFIGS
    started = time.perf_counter()
    result = dict(device="cpu", torch=torch.__version__, warmup=args.warmup, steps=args.steps,
                  optimizer="AdamW(fused=True)" if args.fused_adamw else "AdamW (foreach)", runs=[])
    for index, cfg in enumerate(configs):
        if args.only and not any(part in cfg.name for part in args.only.split(",")):
            continue
        left = args.budget_s - (time.perf_counter() - started)
        if left < 45:
            result["runs"].append(dict(config=asdict(cfg), skipped="out of time budget"))
            continue
        print(f"--- {cfg.name} ({left:.0f} s left)", flush=True)
        t0 = time.perf_counter()
        # a process per configuration: nothing (allocator cache, compiled code) outlives it
        cmd = [sys.executable, __file__, "--measure", "--one", str(index), "--warmup", str(args.warmup),
               "--steps", str(args.steps), *(["--smoke"] if smoke else []),
               *(["--fused-adamw"] if args.fused_adamw else []), *(["--profile"] if args.profile else [])]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
            run = json.loads(lines[-1][len(RESULT):]) if lines else dict(error=proc.stderr[-2000:])
            if args.profile:
                print("\n".join(ln for ln in proc.stdout.splitlines() if not ln.startswith(RESULT)), flush=True)
        except subprocess.TimeoutExpired:
            run = dict(skipped="out of time budget (killed)")
        run.update(config=asdict(cfg), wall_s=time.perf_counter() - t0)
        result["device"] = run.pop("device", result["device"])
        print(json.dumps({k: v for k, v in run.items() if k != "steps_s"}), flush=True)
        result["runs"].append(run)
        Path(args.out).write_text(json.dumps(result, indent=1))


def measure_child(args) -> None:
    """`--one INDEX`: one configuration in this process; prints RESULT and its JSON."""
    import torch.distributed as dist

    device = "cpu" if args.smoke else "cuda:0"
    cfg = (SMOKE_CONFIGS if args.smoke else CONFIGS)[args.one]
    try:
        run = measure_one(cfg, warmup=args.warmup, steps=args.steps, device=device, fused_adamw=args.fused_adamw,
                          profile=args.profile)
    except torch.OutOfMemoryError as e:
        run = dict(oom=str(e).splitlines()[0])
    except Exception as e:  # noqa: BLE001 - recorded, the next configuration still runs
        run = dict(error=f"{type(e).__name__}: {e}"[:2000])
    if not args.smoke:
        run["device"] = torch.cuda.get_device_name(0)
    if dist.is_initialized():
        dist.destroy_process_group()
    print(RESULT + json.dumps(run), flush=True)


def _profile_name(device: str) -> str:
    name = device.upper()
    for key, profile in (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80g"), ("CPU", "cpu")):
        if key in name:
            return profile
    raise SystemExit(f"no autoshard device profile for {device!r}")


def predict(cfg: Config, hw_name: str, tables: dict) -> dict:
    from autoshard.commands.common import cost_table_for
    from autoshard.hardware import load_hardware
    from autoshard.ir import Mesh, Recompute
    from autoshard.passes.cost.compiled import compile_table
    from autoshard.passes.cost.cost import estimate
    from autoshard.passes.cost.layout import Layout

    hw = load_hardware(hw_name)
    if cfg.model not in tables:
        spec, table = cost_table_for(cfg.model, spinner=False, kernels=hw.kernels)
        tables[cfg.model] = (spec, compile_table(table, spec))
    spec, ct = tables[cfg.model]
    layout = Layout(mesh=Mesh(), micro_batch=cfg.micro_batch, zero=0, recompute=Recompute(cfg.recompute),
                    precision="bf16-mixed")
    est = estimate(ct, spec, hw, layout, global_batch=cfg.global_batch, seq_len=cfg.seq)
    return dict(step_s=est.step_time_s, memory_bytes=est.memory.total, memory=est.memory.as_gb(), fits=est.fits,
                time={k: v for k, v in asdict(est.time).items()})


def _pair_agreement(rows: list[tuple[float, float]]) -> tuple[int, int]:
    right = total = 0
    for (m1, p1), (m2, p2) in combinations(rows, 2):
        if abs(m1 - m2) / max(m1, m2) < 0.03:  # a tie within noise: no order to get right
            continue
        total += 1
        right += (m1 < m2) == (p1 < p2)
    return right, total


def report(args) -> None:
    data = json.loads(Path(args.report).read_text())
    hw_name = _profile_name(data["device"])
    print(f"{data['device']} (profile {hw_name}), torch {data['torch']}, median of {data['steps']} steps")
    print(f"{'configuration':44s} {'meas s':>8s} {'pred s':>8s} {'pred/meas':>9s} "
          f"{'meas GB':>8s} {'pred GB':>8s} {'pred/meas':>9s}")
    tables: dict = {}
    by_model: dict[str, list] = {}
    time_ratios, mem_ratios = [], []
    for run in data["runs"]:
        cfg = Config(**run["config"])
        pred = predict(cfg, hw_name, tables)
        if "step_s" not in run:
            why = run.get("oom") and "out of memory" or run.get("skipped") or run.get("error", "")[:60]
            print(f"{cfg.name:44s} {'-':>8s} {pred['step_s']:8.3f} {'':9s} {'-':>8s} "
                  f"{pred['memory_bytes'] / 1e9:8.1f}   ({why}; predicted fits={pred['fits']})")
            continue
        tr = pred["step_s"] / run["step_s"]
        time_ratios.append(tr)
        peak = run.get("peak_bytes")  # none on the CPU (--smoke)
        mr = pred["memory_bytes"] / peak if peak else float("nan")
        if peak:
            mem_ratios.append(mr)
        by_model.setdefault((cfg.model, cfg.compiled), []).append((run["step_s"] / cfg.global_batch,
                                                                   pred["step_s"] / cfg.global_batch))
        print(f"{cfg.name:44s} {run['step_s']:8.3f} {pred['step_s']:8.3f} {tr:9.2f} "
              f"{(peak or float('nan')) / 1e9:8.1f} {pred['memory_bytes'] / 1e9:8.1f} {mr:9.2f}")
    if time_ratios:
        right = total = 0
        for rows in by_model.values():
            r, t = _pair_agreement(rows)
            right, total = right + r, total + t
        print(f"\nstep time pred/meas: median {statistics.median(time_ratios):.2f}, "
              f"range {min(time_ratios):.2f}-{max(time_ratios):.2f}")
        if mem_ratios:
            print(f"peak memory pred/meas: median {statistics.median(mem_ratios):.2f}, "
                  f"range {min(mem_ratios):.2f}-{max(mem_ratios):.2f}")
        print(f"pairs of one model (eager / compiled apart) ranked right by time per sequence: {right}/{total}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--measure", action="store_true", help="run CONFIGS on cuda:0 (needs a CUDA device)")
    mode.add_argument("--report", metavar="MEASURED_JSON", help="price a --measure file's runs and compare")
    p.add_argument("--out", default="measured.json", help="where --measure writes (default %(default)s)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting configurations after this")
    p.add_argument("--smoke", action="store_true", help="--measure SMOKE_CONFIGS on the CPU (checks this script)")
    p.add_argument("--fused-adamw", action="store_true", help="AdamW(fused=True), as production runs (default: "
                   "torch's foreach AdamW, which allocates fp32 temporaries the size of the parameters)")
    p.add_argument("--profile", action="store_true", help="print each configuration's 15 costliest CUDA kernels "
                   "(one extra profiled step)")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the per-configuration process
    p.add_argument("--only", default="",
                   help="run only configurations whose name contains one of these (comma-separated)")
    args = p.parse_args()
    if args.measure and args.one is not None:
        measure_child(args)
    else:
        measure(args) if args.measure else report(args)


if __name__ == "__main__":
    main()

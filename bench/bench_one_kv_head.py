"""Multi-query attention under tp: which classes offer tp with one KV head (`num_key_value_heads: 1`)?

For every class `bench/families_sweep.json` plans, its tiny config (autoshard/models/tiny.py) as it is and with
its KV head count set to 1 is read by `spec_from_hf_config` (the tp strategy proven on the model's own traced graph,
passes/capture/tp_proof.py); printed per class: tp offered, or the refusal's first words. The counts at the end
are what docs/decoders.md quotes. Proof only, no ranks spawned (`autoshard verify` trains a class under tp).

    python bench/bench_one_kv_head.py [--types llama,gemma2]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import warnings

TABLE = pathlib.Path(__file__).with_name("families_sweep.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="", help="comma-separated model types (default: those the families table plans)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")

    from autoshard.models.facts import ALIASES
    from autoshard.models.presets import spec_from_hf_config
    from autoshard.models.tiny import tiny_config

    types = args.types.split(",") if args.types else [t for t, row in json.loads(TABLE.read_text()).items()
                                                      if row["status"] == "ok"]
    counts = collections.Counter()
    for model_type in types:
        for variant in ("as is", "one KV head"):
            config = tiny_config(model_type)
            names = [n for n in ALIASES["kv_heads"] if getattr(config, n, None)]
            if variant == "one KV head":
                if not names:
                    continue
                for name in names:
                    setattr(config, name, 1)
            try:
                why = dict(spec_from_hf_config(config, name=model_type).refused).get("tp")
            except Exception as e:  # a config the class does not build with one KV head
                why = f"{type(e).__name__}: {e}"
            counts[variant, why is None] += 1
            print(f"{model_type:28s} {variant:12s} {'tp offered' if why is None else why[:110]}", flush=True)
    for variant in ("as is", "one KV head"):
        print(f"{variant}: tp offered for {counts[variant, True]} of {counts[variant, True] + counts[variant, False]}")


if __name__ == "__main__":
    main()

"""Train a tiny HF Mamba-2 for a few steps under a hand-given plan.

    torchrun --nproc-per-node 4 examples/train_mamba2.py --plan dp=2,tp=2
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_llama import main  # noqa: E402

if __name__ == "__main__":
    main("mamba2-tiny")

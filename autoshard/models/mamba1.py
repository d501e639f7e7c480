"""Published Mamba-1 sizes as `package.module:factory` callables for the command line
(`autoshard plan --model autoshard.models.mamba1:mamba_2_8b ...`): HF `MambaForCausalLM` built from the
configs of state-spaces' checkpoints (github.com/state-spaces/mamba README, "Pretrained Models": d_model and
n_layer per size; the `-hf` checkpoints' config.json: vocabulary 50280, state 16, expand 2, conv 4, dt rank
ceil(d_model / 16), tied embeddings). Random weights; the command line builds them on the meta device."""

from __future__ import annotations

# size -> (d_model, n_layer)
SIZES = {"130m": (768, 24), "370m": (1024, 48), "790m": (1536, 48), "1.4b": (2048, 48), "2.8b": (2560, 64)}


def mamba(size: str):
    """The HF MambaForCausalLM of the published Mamba-1 `size` (a key of SIZES)."""
    from transformers import AutoModelForCausalLM, MambaConfig

    if size not in SIZES:
        raise ValueError(f"unknown Mamba-1 size {size!r}; known: {', '.join(SIZES)}")
    hidden, layers = SIZES[size]
    config = MambaConfig(vocab_size=50280, hidden_size=hidden, num_hidden_layers=layers, state_size=16, expand=2,
                         conv_kernel=4, time_step_rank="auto", tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config)


def mamba_130m():
    return mamba("130m")


def mamba_1_4b():
    return mamba("1.4b")


def mamba_2_8b():
    return mamba("2.8b")

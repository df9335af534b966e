"""Presets: the paper's models as plain data (Vaswani et al., 2017, Table 3).

Each preset is a nested dict of overrides on top of the defaults in :mod:`aiayn.config`
(which are the base model's). Names say which row of Table 3 they reproduce:
``a_h4_dk128`` is row (A) with h = 4 and d_k = d_v = 128, ``c_n2`` is row (C) with N = 2, and so on.

``PAPER_PARAMS_M`` holds the parameter counts (millions) printed in Table 3, for the rows that
have one; ``docs/faithfulness.md`` compares them with ours (``scripts/param_table.py``).
"""

from __future__ import annotations

from typing import Any

from aiayn.errors import ConfigError

Preset = dict[str, dict[str, Any]]

# Table 3, "base": N=6, d_model=512, d_ff=2048, h=8, d_k=d_v=64, P_drop=0.1, eps_ls=0.1, 100K steps.
_BASE: Preset = {"model": {}, "train": {"max_steps": 100000, "average_last": 5}}

# GPT's and BERT-base's shape: 12 layers of 768 with 12 heads and 3,072-wide feed-forward.
_BASE_FAMILY: dict[str, Any] = {
    "d_model": 768,
    "d_ff": 3072,
    "n_heads": 12,
    "n_layers": 12,
    "positional": "learned",
    "max_positions": 512,
}

PRESETS: dict[str, Preset] = {
    "base": _BASE,
    # Table 3, "big": N=6, d_model=1024, d_ff=4096, h=16, P_drop=0.3, 300K steps; §6.1 averages
    # the last 20 checkpoints.
    "big": {
        "model": {"d_model": 1024, "d_ff": 4096, "n_heads": 16, "dropout": 0.3},
        "train": {"max_steps": 300000, "average_last": 20},
    },
    # §6.1: the big model for English-French used P_drop = 0.1 instead of 0.3.
    "big_enfr": {
        "model": {"d_model": 1024, "d_ff": 4096, "n_heads": 16, "dropout": 0.1},
        "train": {"max_steps": 300000, "average_last": 20},
    },
    # Rows (A) to (E): §6.2 evaluates the variations "with no checkpoint averaging".
    # Row (A): number of heads, with d_k = d_v = d_model / h keeping computation constant.
    "a_h1_dk512": {"model": {"n_heads": 1, "d_k": 512, "d_v": 512}, "train": {"average_last": 0}},
    "a_h4_dk128": {"model": {"n_heads": 4, "d_k": 128, "d_v": 128}, "train": {"average_last": 0}},
    "a_h16_dk32": {"model": {"n_heads": 16, "d_k": 32, "d_v": 32}, "train": {"average_last": 0}},
    "a_h32_dk16": {"model": {"n_heads": 32, "d_k": 16, "d_v": 16}, "train": {"average_last": 0}},
    # Row (B): attention key size d_k alone (d_v stays 64).
    "b_dk16": {"model": {"d_k": 16, "d_v": 64}, "train": {"average_last": 0}},
    "b_dk32": {"model": {"d_k": 32, "d_v": 64}, "train": {"average_last": 0}},
    # Row (C): depth, width and feed-forward size.
    "c_n2": {"model": {"n_layers": 2}, "train": {"average_last": 0}},
    "c_n4": {"model": {"n_layers": 4}, "train": {"average_last": 0}},
    "c_n8": {"model": {"n_layers": 8}, "train": {"average_last": 0}},
    "c_dmodel256": {"model": {"d_model": 256, "d_k": 32, "d_v": 32}, "train": {"average_last": 0}},
    "c_dmodel1024": {
        "model": {"d_model": 1024, "d_k": 128, "d_v": 128},
        "train": {"average_last": 0},
    },
    "c_dff1024": {"model": {"d_ff": 1024}, "train": {"average_last": 0}},
    "c_dff4096": {"model": {"d_ff": 4096}, "train": {"average_last": 0}},
    # Row (D): residual dropout and label smoothing.
    "d_dropout0": {"model": {"dropout": 0.0}, "train": {"average_last": 0}},
    "d_dropout0_2": {"model": {"dropout": 0.2}, "train": {"average_last": 0}},
    "d_ls0": {"train": {"average_last": 0, "label_smoothing": 0.0}},
    "d_ls0_2": {"train": {"average_last": 0, "label_smoothing": 0.2}},
    # Row (E): learned positional embeddings instead of sinusoids.
    "e_learned_pos": {"model": {"positional": "learned"}, "train": {"average_last": 0}},
    # Not in the paper: sizes for CPUs and tests.
    # "small": the 256-wide 3+3 model of the benchmarks and the CPU demo.
    "small": {
        "model": {"d_model": 256, "d_ff": 1024, "n_heads": 4, "n_layers": 3},
        "train": {"average_last": 5},
    },
    # The other two families (docs/families.md), without label smoothing. "*_small": the
    # "small" shape; "gpt_base": GPT's 12 × 768 (Radford et al., 2018); "bert_base": BERT-base
    # (Devlin et al., 2019); both with learned positions over 512, as those models have.
    # Deviation: GPT's and BERT's shapes, not their layers: the paper's ReLU FFN (they use
    # GELU: model.activation=gelu), embeddings scaled by √d_model with no LayerNorm, and for
    # mlm the bare tied projection as the head (BERT's has a dense + GELU + LayerNorm
    # transform and an output bias): one set of layers for the three families
    # (docs/families.md, "The paper's layers in GPT's and BERT's shapes").
    "gpt_small": {
        "model": {"task": "lm", "d_model": 256, "d_ff": 1024, "n_heads": 4, "n_layers": 4},
        "train": {"label_smoothing": 0.0, "average_last": 5},
    },
    "gpt_base": {
        "model": {"task": "lm", **_BASE_FAMILY},
        "train": {"label_smoothing": 0.0, "average_last": 5},
    },
    "bert_small": {
        "model": {"task": "mlm", "d_model": 256, "d_ff": 1024, "n_heads": 4, "n_layers": 4},
        "train": {"label_smoothing": 0.0, "average_last": 5},
    },
    "bert_base": {
        "model": {"task": "mlm", **_BASE_FAMILY},
        "train": {"label_smoothing": 0.0, "average_last": 5},
    },
    # The shape of OPUS-MT's Marian models (the base model with Swish, the sinusoids in halves,
    # an output bias, LayerNorm eps 1e-5; BOS outside the output as Marian has none): what
    # `aiayn import-marian` writes (docs/interop.md), and a start for a model meant to match one.
    "marian": {
        "model": {
            "activation": "swish",
            "positional_layout": "halves",
            "final_logits_bias": True,
            "layer_norm_eps": 1e-5,
            "max_positions": 512,
            "bos_output": False,
        },
        "train": {"max_steps": 100000, "average_last": 5},
    },
    # The attention-RNN baselines the paper compares with (docs/rnn.md), sized for Multi30k
    # on a 2-core CPU (about the small Transformer's time per update; rnn_hidden=512 is
    # closer to the papers' proportions and about twice as slow). The training recipe is the
    # run's (Adam and Eq. 3), with each paper's gradient-norm clipping.
    # "rnnsearch" (Bahdanau et al., 2015; paper: embeddings 620, GRUs of 1000, maxout 500):
    # embeddings 256, a 1-layer bidirectional GRU encoder of 256 per direction (annotations
    # 512), a GRU decoder of 256, maxout output 256; gradient norm clipped to 1.
    "rnnsearch": {
        "model": {"arch": "bahdanau", "d_model": 256, "rnn_hidden": 256, "n_layers": 1},
        "train": {"clip_norm": 1.0, "average_last": 5},
    },
    # "luong" (Luong et al., 2015; paper: 4 layers of 1000, dropout 0.2): embeddings 256,
    # 2-layer LSTM encoder and decoder of 256, the general score, input feeding, dropout 0.2;
    # gradient norm clipped to 5.
    "luong": {
        "model": {
            "arch": "luong",
            "d_model": 256,
            "rnn_hidden": 256,
            "n_layers": 2,
            "dropout": 0.2,
            "luong_score": "general",
            "input_feeding": True,
        },
        "train": {"clip_norm": 5.0, "average_last": 5},
    },
    # "tiny": for unit tests and smoke runs only.
    "tiny": {
        "model": {
            "vocab_size": 64,
            "d_model": 32,
            "d_ff": 64,
            "n_heads": 4,
            "n_layers": 2,
            "max_positions": 256,
        },
        "train": {
            "warmup_steps": 100,
            "max_steps": 200,
            "average_last": 2,
            "compile_step": False,  # smoke runs and tests: no half-minute compile at the end
        },
    },
}

# Parameter counts in millions as printed in Table 3 (rows without a figure are absent).
PAPER_PARAMS_M: dict[str, float] = {
    "base": 65,
    "b_dk16": 58,
    "b_dk32": 60,
    "c_n2": 36,
    "c_n4": 50,
    "c_n8": 80,
    "c_dmodel256": 28,
    "c_dmodel1024": 168,
    "c_dff1024": 53,
    "c_dff4096": 90,
    "big": 213,
}

# The rows of Table 3 in the paper's order, for reports.
TABLE3_ROWS: list[str] = [
    "base",
    "a_h1_dk512",
    "a_h4_dk128",
    "a_h16_dk32",
    "a_h32_dk16",
    "b_dk16",
    "b_dk32",
    "c_n2",
    "c_n4",
    "c_n8",
    "c_dmodel256",
    "c_dmodel1024",
    "c_dff1024",
    "c_dff4096",
    "d_dropout0",
    "d_dropout0_2",
    "d_ls0",
    "d_ls0_2",
    "e_learned_pos",
    "big",
]


def preset_overrides(name: str) -> Preset:
    """The overrides of preset ``name`` (a fresh copy), or a ConfigError listing the valid ones."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return {section: dict(values) for section, values in PRESETS[name].items()}

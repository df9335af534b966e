"""Attention weights of a translation, per layer and head, and their pictures.

The weights are recomputed with :func:`aiayn.model.attention.naive_attention` from the
inputs each attention module receives during one teacher-forced pass over the source and the
translation (forward hooks, so the model itself is unchanged): encoder self-attention (S × S),
decoder self-attention (T × T) and cross-attention (T × S), where S counts the source tokens
and EOS, T the output tokens and EOS. Decoder row i is the step that produces output token i.
A layer with an attention pattern (aiayn.model.patterns) gives its pattern's weights
(``AttentionPattern.weights``; lsh's depend on the data); Linformer's fall on projected rows,
not tokens, and a model with it has no pictures (UserError).

An RNN baseline (``model.arch``) has no self-attention and one attention over the source: its
own :meth:`~aiayn.model.rnn.RNNSearch.cross_attention_weights`, one "layer" of one "head".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor, nn

from aiayn.data.collate import BOS_ID, EOS_ID
from aiayn.errors import UserError
from aiayn.model.attention import MultiHeadAttention, naive_attention
from aiayn.model.families import TranslationModel
from aiayn.model.rnn import LuongNMT, RNNSearch


def _recorder(store: list[Tensor]) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], _: Any) -> None:
        assert isinstance(module, MultiHeadAttention)
        x = args[0]
        memory = args[1] if len(args) > 1 else kwargs.get("memory")
        mask = args[2] if len(args) > 2 else kwargs.get("mask")
        causal = args[3] if len(args) > 3 else kwargs.get("causal", False)
        if module.self_attention:
            q, k, v = module.project_qkv(x)  # (B, H, T, Dh) each
        else:
            assert memory is not None
            q = module.project_q(x)
            k, v = module.project_kv(memory)
        # In float32: an accelerated bfloat16 model gives float32 keys and values.
        q, k, v = q.float(), k.float(), v.float()
        if module.pattern is not None:  # over the keys its pattern leaves each query
            key_pad = None if mask is None else ~mask[:, 0, 0, :]
            weights = module.pattern.weights(q, k, key_pad, causal)
        else:
            _, weights = naive_attention(q, k, v, mask, causal)  # (B, H, T, S)
        store.append(weights[0].float().cpu())

    return hook


@torch.inference_mode()
def attention_weights(
    model: TranslationModel, src: Sequence[int], output: Sequence[int]
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Encoder, decoder and cross-attention weights per layer, each (heads, rows, columns),
    for source ids ``src`` and output ids ``output`` (neither with BOS/EOS). An RNN model
    gives no self-attention and one (1, T, S) cross-attention."""
    device = next(model.parameters()).device
    src_ids = torch.tensor([[*src, EOS_ID]], device=device)  # (1, S)
    tgt_in = torch.tensor([[BOS_ID, *output]], device=device)  # (1, T)
    if isinstance(model, (RNNSearch, LuongNMT)):
        weights = model.cross_attention_weights(src_ids, None, tgt_in)  # (1, T, S)
        return [], [], [weights.float().cpu()]
    encoder: list[Tensor] = []
    decoder: list[Tensor] = []
    cross: list[Tensor] = []
    handles = []
    hooked = [(layer.self_attn, encoder) for layer in model.encoder.layers]
    for decoder_layer in model.decoder.layers:
        assert decoder_layer.cross_attn is not None
        hooked += [(decoder_layer.self_attn, decoder), (decoder_layer.cross_attn, cross)]
    for attention, _ in hooked:
        pattern = attention.pattern
        if pattern is not None and not pattern.weighs_positions:
            raise UserError(
                f"{pattern.name} attention weighs projected rows, not tokens: it has no "
                "attention pictures"
            )
    for attention, store in hooked:
        handles.append(attention.register_forward_hook(_recorder(store), with_kwargs=True))
    try:
        model(src_ids, torch.zeros_like(src_ids, dtype=torch.bool), tgt_in)
    finally:
        for handle in handles:
            handle.remove()
    return encoder, decoder, cross


_PRODUCED = "output token (row: the step producing it)"


def plot_layer(
    weights: Tensor,
    rows: list[str],
    cols: list[str],
    title: str,
    path: Path,
    axis_names: tuple[str, str] = ("output token", "source token"),
) -> None:
    """One PNG: a heat map per head, (H, len(rows), len(cols)) weights in [0, 1], in a grid of
    at most four columns that share their axes (token names on the outer panels only);
    ``axis_names`` titles the rows and the columns."""
    n_heads = weights.size(0)
    n_cols = n_heads if n_heads <= 2 else 2 if n_heads <= 4 else 4
    n_rows = (n_heads + n_cols - 1) // n_cols
    cell = 0.2  # inches per token: room for an 8-point label
    label_room = 0.09 * max(len(t) for t in [*rows, *cols]) + 0.4
    panel_w, panel_h = max(2.0, len(cols) * cell), max(2.0, len(rows) * cell)
    fig = Figure(
        figsize=(n_cols * panel_w + label_room + 1.2, n_rows * (panel_h + 0.3) + label_room + 0.6),
        layout="constrained",
    )
    FigureCanvasAgg(fig)
    axes = fig.subplots(n_rows, n_cols, squeeze=False, sharex=True, sharey=True)
    image = None
    for head in range(n_rows * n_cols):
        ax = axes[head // n_cols][head % n_cols]
        if head >= n_heads:
            ax.axis("off")
            continue
        image = ax.imshow(weights[head].numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_title(f"head {head + 1}", fontsize=10)
        ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=8)
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        # Names on the outer panels only: the last filled row of each column, the first column.
        ax.tick_params(labelbottom=head + n_cols >= n_heads, labelleft=head % n_cols == 0)
    assert image is not None
    fig.supylabel(axis_names[0])
    fig.supxlabel(axis_names[1])
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="attention weight")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def token_labeler(tokenizer: Any, source: bool = False) -> Callable[[int], str]:
    """Names tokens on the axes: the subword piece when the tokenizer has ``piece(id)`` (with
    ``source``, ``source_piece(id)`` where a tokenizer has separate vocabularies)."""
    piece = getattr(tokenizer, "piece", None)
    if source:
        piece = getattr(tokenizer, "source_piece", piece)

    def label(token_id: int) -> str:
        return str(piece(token_id)) if piece is not None else tokenizer.decode([token_id])

    return label


def write_cross_attention_picture(
    model: TranslationModel,
    src: Sequence[int],
    output: Sequence[int],
    label: Callable[[int], str],
    path: str | Path,
    source_label: Callable[[int], str] | None = None,
) -> Path:
    """One PNG: the encoder-decoder attention of the last decoder layer, a heat map per head;
    ``source_label`` names source tokens (default: ``label``)."""
    _, _, cross = attention_weights(model, src, output)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [label(i) for i in output] + ["</s>"]
    cols = [(source_label or label)(i) for i in src] + ["</s>"]
    title = f"encoder-decoder attention, layer {len(cross)}"
    plot_layer(
        cross[-1],
        rows,
        cols,
        title,
        path,
        ("output token (the step that produces it)", "source token"),
    )
    return path


def write_attention_pictures(
    model: TranslationModel,
    src: Sequence[int],
    output: Sequence[int],
    label: Callable[[int], str],
    out_dir: str | Path,
    source_label: Callable[[int], str] | None = None,
) -> list[Path]:
    """PNG heat maps for every layer of the three attention kinds, in ``out_dir``:
    ``encoder_layer{i}.png``, ``decoder_layer{i}.png``, ``cross_layer{i}.png`` (i from 1).
    ``label(id)`` names a token on the axes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    encoder, decoder, cross = attention_weights(model, src, output)
    source = [(source_label or label)(i) for i in src] + ["</s>"]
    target_in = ["<s>"] + [label(i) for i in output]
    target_out = [label(i) for i in output] + ["</s>"]
    paths = []
    kinds = [
        ("encoder", "encoder self-attention", encoder, source, source,
         ("query token", "key token")),
        ("decoder", "decoder self-attention", decoder, target_out, target_in,
         (_PRODUCED, "decoder input token")),
        ("cross", "encoder-decoder attention", cross, target_out, source,
         (_PRODUCED, "source token")),
    ]  # fmt: skip
    for name, title, layers, rows, cols, axis_names in kinds:
        for i, weights in enumerate(layers, start=1):
            path = out_dir / f"{name}_layer{i}.png"
            plot_layer(weights, rows, cols, f"{title}, layer {i}", path, axis_names)
            paths.append(path)
    return paths

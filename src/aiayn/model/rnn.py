"""The attention-RNN translation models that the Transformer replaced (``model.arch``).

- :class:`RNNSearch` (``"bahdanau"``; Bahdanau, Cho and Bengio, 2015, "Neural machine
  translation by jointly learning to align and translate"): a bidirectional GRU encoder whose
  annotations ``h_j = [h→_j; h←_j]`` an additive attention reads from the previous decoder
  state, a GRU decoder fed with the previous word and the context, and a maxout deep output.
- :class:`LuongNMT` (``"luong"``; Luong, Pham and Manning, 2015, "Effective approaches to
  attention-based neural machine translation"): stacked LSTMs, global attention from the
  current top decoder state with a ``dot``, ``general`` or ``concat`` score, the attentional
  hidden state ``h̃_t = tanh(W_c[c_t; h_t])`` and input feeding.

Both are models of the translation pipeline with the Transformer's API: ``forward(src_ids,
src_pad, tgt_in) -> logits`` (teacher forcing; ``project=False`` gives the hidden states
before the pre-softmax projection ``out_proj``, which the fused training loss takes), and for
search ``encode``, ``init_cache``, ``decode_step``, ``log_probs_step``, ``step_hidden`` and
``project``. :meth:`cross_attention_weights` gives the attention of every output step over the
source (``aiayn attention``).

Sizes: the embeddings have ``d_model`` dimensions, the recurrent states ``model.rnn_hidden``
(default ``d_model``). The last layer before the projection (the maxout output, ``h̃_t``) has
``d_model`` too, so that the projection can be tied to the target embedding
(``model.tie_output``, by default with ``model.share_embeddings``).

Padding: sources are padded at the end (``src_pad`` True there, as collate makes them); the
encoders read packed sequences, so padding changes nothing, and the attention gives padded
positions a weight of exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from aiayn.config import ModelConfig
from aiayn.model.embedding import output_projection, token_embedding
from aiayn.model.transformer import check_cache_size

Score = Literal["dot", "general", "concat"]


@dataclass
class EncoderStates:
    """What an RNN encoder hands its decoder, one row per sentence: ``memory`` (B, S, D), the
    annotations that attention reads, and ``final``, the encoder states the decoder's initial
    state is made from (each (B, ...))."""

    memory: Tensor
    final: list[Tensor]


@dataclass
class RNNCache:
    """State of an incremental decode over rows = sentences × ``beam_size``, the layout of
    :class:`~aiayn.model.cache.DecoderCache`: rows ``i * beam_size .. (i + 1) * beam_size - 1``
    decode sentence i, whose memory and attention keys are stored once for its beams.

    ``states`` are the decoder's recurrent states, one row per decoder row (each (rows, ...)).
    ``reorder(rows)`` gathers them (beam search: rows move within a sentence's group only);
    ``keep(rows)`` keeps the listed rows, whole groups of ``beam_size`` per kept sentence, and
    those sentences' memory."""

    memory: Tensor  # (sentences, S, D_memory)
    keys: Tensor  # (sentences, S, D_key): the memory as the attention's keys, projected once
    src_pad: Tensor | None  # (sentences, S), True at padding
    states: list[Tensor]
    length: int
    max_len: int
    beam_size: int = 1

    @property
    def batch_size(self) -> int:
        """Decoder rows (sentences × beam_size)."""
        return self.states[0].size(0)

    def reorder(self, rows: Tensor) -> None:
        """Row i becomes old row ``rows[i]`` (same number of rows)."""
        if rows.numel() != self.batch_size:
            raise ValueError(
                f"reorder expects {self.batch_size} row indices, got {rows.numel()}; "
                "use keep() to change the batch size"
            )
        self.states = [state.index_select(0, rows) for state in self.states]

    def keep(self, rows: Tensor) -> None:
        """Keep only ``rows`` (in that order), whole groups of ``beam_size`` rows."""
        n = rows.numel()
        if n > self.batch_size:
            raise ValueError(f"keep got {n} rows for a batch of {self.batch_size}")
        if n % self.beam_size != 0:
            raise ValueError(f"keep needs whole groups of {self.beam_size} rows, got {n}")
        self.states = [state.index_select(0, rows) for state in self.states]
        sentences = rows[:: self.beam_size] // self.beam_size
        self.memory = self.memory.index_select(0, sentences)
        self.keys = self.keys.index_select(0, sentences)
        if self.src_pad is not None:
            self.src_pad = self.src_pad.index_select(0, sentences)


class GlobalAttention(nn.Module):
    """Attention of queries q over the memory h̄_1..h̄_S, with one of Luong et al.'s scores
    (§3.1, their Eq. 8):

    - ``dot``: ``score(q, h̄_s) = qᵀ h̄_s`` (query and memory of one size);
    - ``general``: ``qᵀ W_a h̄_s``;
    - ``concat``: ``v_aᵀ tanh(W_a [q; h̄_s]) = v_aᵀ tanh(W_q q + W_k h̄_s)``: Bahdanau et al.'s
      additive score ``e_ij = v_aᵀ tanh(W_a s_{i-1} + U_a h_j)`` (their Eq. 6 and A.1.2).

    ``a = softmax(score)`` over the source positions (padding set to -inf first, so its
    weight is 0) and the context ``c = Σ_s a_s h̄_s``. The memory-side product (``W_a h̄_s``,
    ``W_k h̄_s``) does not depend on the query: :meth:`keys` computes it once per sentence.
    """

    def __init__(self, score: Score, query_size: int, memory_size: int, size: int) -> None:
        super().__init__()
        self.score = score
        self.key_proj: nn.Linear | None = None
        self.query_proj: nn.Linear | None = None
        self.v: nn.Linear | None = None
        if score == "dot":
            if query_size != memory_size:
                raise ValueError(f"the dot score needs query size {query_size} == {memory_size}")
        elif score == "general":
            self.key_proj = nn.Linear(memory_size, query_size, bias=False)  # W_a
        else:
            self.query_proj = nn.Linear(query_size, size, bias=False)  # W_q (Bahdanau: W_a)
            self.key_proj = nn.Linear(memory_size, size, bias=False)  # W_k (Bahdanau: U_a)
            self.v = nn.Linear(size, 1, bias=False)  # v_a

    def keys(self, memory: Tensor) -> Tensor:
        """The memory's part of the score, (N, S, D_key)."""
        return memory if self.key_proj is None else self.key_proj(memory)

    def forward(
        self, query: Tensor, keys: Tensor, memory: Tensor, src_pad: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Contexts (N, K, D_memory) and weights (N, K, S) for ``query`` (N, K, D_query): K
        queries per memory row (a sentence's beams, or its target positions)."""
        if self.v is not None:
            assert self.query_proj is not None
            hidden = torch.tanh(self.query_proj(query)[:, :, None] + keys[:, None])  # (N,K,S,A)
            scores = self.v(hidden).squeeze(-1)  # (N, K, S)
        else:
            scores = torch.bmm(query, keys.transpose(1, 2))  # (N, K, S)
        if src_pad is not None:
            scores = scores.masked_fill(src_pad[:, None], float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(memory.dtype)
        return torch.bmm(weights, memory), weights


def run_encoder(
    rnn: nn.RNNBase, x: Tensor, src_pad: Tensor | None
) -> tuple[Tensor, Tensor | tuple[Tensor, Tensor]]:
    """``rnn`` (batch first) over ``x`` (B, S, D) whose rows are padded at the end where
    ``src_pad`` is True: as packed sequences, so that each row is read to its own last token
    (and backwards from it). Returns the outputs (B, S, D_out), zero at padding, and the final
    states (the rows in input order)."""
    if src_pad is None:
        return rnn(x)
    lengths = (~src_pad).sum(1).cpu()
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    out, final = rnn(packed)
    memory, _ = pad_packed_sequence(out, batch_first=True, total_length=x.size(1))
    return memory, final


def _embeddings(config: ModelConfig) -> tuple[nn.Embedding, nn.Embedding, nn.Linear]:
    """Source and target embeddings (one matrix with ``share_embeddings``) of ``d_model``
    dimensions, and the pre-softmax projection from ``d_model`` (tied to the target embedding
    with ``tied_output``). No √d_model scale and no positions: the recurrence orders words."""
    src = token_embedding(config.vocab_size, config.d_model)
    tgt = (
        src
        if config.share_embeddings
        else token_embedding(config.target_vocab_size, src.weight.size(1))
    )
    out_proj = output_projection(tgt, tied=config.tied_output, bias=config.final_logits_bias)
    return src, tgt, out_proj


def _layer_dropout(config: ModelConfig) -> float:
    """nn.GRU/nn.LSTM's dropout between stacked layers (none with one layer, where PyTorch
    warns about it)."""
    return config.dropout if config.n_layers > 1 else 0.0


class _AttentionRNN(nn.Module):
    """What the two RNN models share: teacher-forced logits and attention weights from the
    subclass's ``_teacher_forced``, and incremental decoding from its ``_start`` (the cache
    of the first step) and ``step_hidden`` (one step's output before the projection)."""

    config: ModelConfig
    out_proj: nn.Linear

    def forward(
        self, src_ids: Tensor, src_pad: Tensor | None, tgt_in: Tensor, project: bool = True
    ) -> Tensor:
        """Teacher-forced logits (B, T, V); with ``project=False`` the outputs (B, T, d_model)
        before the pre-softmax projection (RNNsearch's maxout t_i, Luong's h̃_t)."""
        hidden, _ = self._teacher_forced(src_ids, src_pad, tgt_in)
        return self.project(hidden) if project else hidden

    def project(self, hidden: Tensor) -> Tensor:
        """The pre-softmax projection to vocabulary logits (W_o, W_s)."""
        return self.out_proj(hidden)

    @torch.no_grad()
    def cross_attention_weights(
        self, src_ids: Tensor, src_pad: Tensor | None, tgt_in: Tensor
    ) -> Tensor:
        """(B, T, S): row i is the attention of the step that produces output i."""
        return self._teacher_forced(src_ids, src_pad, tgt_in)[1]

    def init_cache(
        self, memory: EncoderStates, src_pad: Tensor | None, max_len: int, beam_size: int = 1
    ) -> RNNCache:
        """A cache for up to ``max_len`` steps of ``beam_size`` rows per sentence of
        ``memory`` (what ``encode`` gave), every row in the decoder's initial state."""
        check_cache_size(self.config, max_len, beam_size)
        return self._start(memory, src_pad, max_len, beam_size)

    def decode_step(self, tokens: Tensor, cache: RNNCache) -> Tensor:
        """Next-token logits (rows, V)."""
        return self.project(self.step_hidden(tokens, cache))

    def log_probs_step(self, tokens: Tensor, cache: RNNCache) -> Tensor:
        """Next-token log-probabilities (rows, V) in float32: the ``step_fn`` of search."""
        return torch.log_softmax(self.decode_step(tokens, cache), dim=-1, dtype=torch.float32)

    def _teacher_forced(
        self, src_ids: Tensor, src_pad: Tensor | None, tgt_in: Tensor
    ) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _start(
        self, encoded: EncoderStates, src_pad: Tensor | None, max_len: int, beam_size: int
    ) -> RNNCache:
        raise NotImplementedError

    def step_hidden(self, tokens: Tensor, cache: RNNCache) -> Tensor:
        raise NotImplementedError


class RNNSearch(_AttentionRNN):
    """RNNsearch (Bahdanau et al., 2015; equations of their appendix A), ``model.arch =
    "bahdanau"``, with E the embeddings (``d_model`` = m), n = ``rnn_hidden``:

    - encoder: a bidirectional GRU (``n_layers`` stacked) over E x; the annotations are
      ``h_j = [h→_j; h←_j]`` (2n) of the top layer;
    - initial decoder state ``s_0 = tanh(W_s h←_1)``, the backward RNN's state at the first
      source word;
    - attention from the previous state: ``e_ij = v_aᵀ tanh(W_a s_{i-1} + U_a h_j)``,
      ``α_ij = softmax_j(e_ij)`` (padding masked out), ``c_i = Σ_j α_ij h_j``;
    - decoder: one GRU layer, ``s_i = GRU([E y_{i-1}; c_i], s_{i-1})``;
    - deep output with maxout: ``t̃_i = U_o s_i + V_o E y_{i-1} + C_o c_i`` (2m), ``t_i =
      max(t̃_{i,2k-1}, t̃_{i,2k})`` (m), ``p(y_i) = softmax(W_o t_i)``; W_o is ``out_proj``.

    Dropout (``model.dropout``) on the embeddings, between stacked encoder layers and on t_i.
    Deviation: Bahdanau et al. describe no dropout; aiayn's preset trains with the run's
    ``model.dropout`` (0.1, the Transformer's P_drop) because its data is Multi30k's 29,000
    sentence pairs, not WMT'14's 348M words, and the comparison (docs/comparison.md) gives
    both models the same regularisation; ``model.dropout=0`` is the paper's model.
    Initialisation as the paper's appendix B.1: recurrent matrices orthogonal, W_a and U_a
    from N(0, 0.001²), v_a and biases 0, every other matrix (embeddings too) from N(0, 0.01²).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config.validate()
        if config.arch != "bahdanau":
            raise ValueError(f"RNNSearch is model.arch = 'bahdanau', not {config.arch!r}")
        self.config = config
        m = config.d_model
        n = self.hidden_size = config.rnn_hidden or config.d_model
        self.src_embed, self.tgt_embed, self.out_proj = _embeddings(config)
        self.dropout = nn.Dropout(config.dropout)
        self.encoder = nn.GRU(
            m,
            n,
            num_layers=config.n_layers,
            batch_first=True,
            bidirectional=True,
            dropout=_layer_dropout(config),
        )
        # Deviation: appendix A's s_0 = tanh(W_s h←_1) and t̃_i = U_o s_i + V_o E y_{i-1} +
        # C_o c_i have no bias; here both layers carry one (n and 2m parameters), zero at
        # initialisation (appendix B.1 sets "all the bias vectors" to 0, so its code had
        # them), so that the model starts at the equations. Kept for the checkpoints that
        # hold them (docs/rnn.md).
        self.init_state = nn.Linear(n, n)  # W_s
        self.attention = GlobalAttention("concat", n, 2 * n, n)
        # Deviation: nn.GRUCell applies the reset gate after the recurrent product,
        # r ⊙ (U s + b), where the paper's candidate state has U (r ⊙ s) (Cho et al.'s two
        # variants; cuDNN's and PyTorch's GRU is the first).
        self.decoder = nn.GRUCell(m + 2 * n, n)
        self.deep_output = nn.Linear(n + m + 2 * n, 2 * m)  # [U_o V_o C_o]
        self._initialise()

    def _initialise(self) -> None:
        for name, param in self.named_parameters():
            if "bias" in name:
                nn.init.zeros_(param)
            elif "weight_hh" in name:  # the three gates' recurrent matrices, each orthogonal
                for block in param.data.chunk(3, dim=0):
                    nn.init.orthogonal_(block)
            elif name.startswith("attention."):
                nn.init.normal_(param, std=0.001)
            else:
                nn.init.normal_(param, std=0.01)
        assert self.attention.v is not None
        nn.init.zeros_(self.attention.v.weight)

    # -- teacher forcing -------------------------------------------------------------------

    def encode(self, src_ids: Tensor, src_pad: Tensor | None) -> EncoderStates:
        """The annotations (B, S, 2n) and h←_1 (B, n)."""
        memory, _ = run_encoder(self.encoder, self.dropout(self.src_embed(src_ids)), src_pad)
        return EncoderStates(memory, [memory[:, 0, self.hidden_size :]])

    def _teacher_forced(
        self, src_ids: Tensor, src_pad: Tensor | None, tgt_in: Tensor
    ) -> tuple[Tensor, Tensor]:
        # The recurrence step by step (the attention reads s_{i-1}), the deep output at once.
        cache = self._start(self.encode(src_ids, src_pad), src_pad, tgt_in.size(1), 1)
        steps = [self._recur(tgt_in[:, i], cache) for i in range(tgt_in.size(1))]
        s, emb, context, weights = (torch.stack(parts, 1) for parts in zip(*steps, strict=True))
        return self._readout(s, emb, context), weights

    def _recur(self, tokens: Tensor, cache: RNNCache) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One decoder step for ``tokens`` (rows,) = y_{i-1}: s_i, E y_{i-1}, c_i and α_i."""
        emb = self.dropout(self.tgt_embed(tokens))  # (rows, m)
        (previous,) = cache.states  # s_{i-1} (rows, n)
        sentences = cache.memory.size(0)
        query = previous.view(sentences, -1, previous.size(-1))  # (sentences, K, n)
        context, weights = self.attention(query, cache.keys, cache.memory, cache.src_pad)
        context = context.flatten(0, 1)  # (rows, 2n)
        state = self.decoder(torch.cat([emb, context], dim=-1), previous)
        cache.states = [state]
        return state, emb, context, weights.flatten(0, 1)

    def _readout(self, state: Tensor, emb: Tensor, context: Tensor) -> Tensor:
        """The maxout deep output t_i (..., m) from s_i, E y_{i-1} and c_i."""
        pre = self.deep_output(torch.cat([state, emb, context], dim=-1))  # (..., 2m)
        return self.dropout(pre.unflatten(-1, (-1, 2)).amax(-1))  # pairs (2k-1, 2k)

    # -- incremental decoding --------------------------------------------------------------

    def _start(
        self, encoded: EncoderStates, src_pad: Tensor | None, max_len: int, beam_size: int
    ) -> RNNCache:
        state = torch.tanh(self.init_state(encoded.final[0]))  # s_0 (B, n)
        memory = encoded.memory
        states = [state.repeat_interleave(beam_size, 0)]
        keys = self.attention.keys(memory)
        return RNNCache(memory, keys, src_pad, states, 0, max_len, beam_size)

    def step_hidden(self, tokens: Tensor, cache: RNNCache) -> Tensor:
        """t_i (rows, d_model) for ``tokens`` (rows,) = y_{i-1}; advances the cache."""
        _check_room(cache)
        hidden = self._readout(*self._recur(tokens, cache)[:3])
        cache.length += 1
        return hidden


class LuongNMT(_AttentionRNN):
    """Global attention (Luong et al., 2015, §3 and §3.1, input feeding §3.3), ``model.arch =
    "luong"``, with ``n_layers`` stacked LSTM layers of H = ``rnn_hidden`` in the encoder and
    the decoder:

    - encoder: the stacked LSTM over the source embeddings; its top-layer outputs are the
      memory h̄_s, and each layer's final (h, c) starts the same decoder layer;
    - decoder: the stacked LSTM over ``[E y_{t-1}; h̃_{t-1}]`` with input feeding
      (``model.input_feeding``, h̃_0 = 0), else over ``E y_{t-1}``; its top state h_t;
    - global attention from h_t: ``a_t(s) = softmax_s(score(h_t, h̄_s))`` with
      ``model.luong_score`` ``dot``, ``general`` (the default) or ``concat``
      (:class:`GlobalAttention`), ``c_t = Σ_s a_t(s) h̄_s``;
    - attentional hidden state ``h̃_t = tanh(W_c [c_t; h_t])`` (Eq. 5), then ``p(y_t) =
      softmax(W_s h̃_t)`` (Eq. 6); W_s is ``out_proj``.

    h̃_t has ``d_model`` dimensions (the paper's equal H), so that W_s can be the target
    embedding. Dropout (``model.dropout``; the paper's 0.2) on the embeddings, between stacked
    LSTM layers and on h̃_t. Parameters are initialised from U(-0.1, 0.1) as in §4.1.

    Deviation: the source is read left to right (the paper reverses it, after Sutskever et al.).
    Without input feeding the decoder LSTM runs over the whole target at once; with it, step by
    step.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config.validate()
        if config.arch != "luong":
            raise ValueError(f"LuongNMT is model.arch = 'luong', not {config.arch!r}")
        self.config = config
        m = config.d_model
        h = self.hidden_size = config.rnn_hidden or config.d_model
        self.input_feeding = config.input_feeding
        self.src_embed, self.tgt_embed, self.out_proj = _embeddings(config)
        self.dropout = nn.Dropout(config.dropout)
        layers, between = config.n_layers, _layer_dropout(config)
        self.encoder = nn.LSTM(m, h, num_layers=layers, batch_first=True, dropout=between)
        feed = m if self.input_feeding else 0
        self.decoder = nn.LSTM(m + feed, h, num_layers=layers, batch_first=True, dropout=between)
        self.attention = GlobalAttention(config.luong_score, h, h, h)
        self.combine = nn.Linear(2 * h, m, bias=False)  # W_c
        for param in self.parameters():
            nn.init.uniform_(param, -0.1, 0.1)

    # -- teacher forcing -------------------------------------------------------------------

    def encode(self, src_ids: Tensor, src_pad: Tensor | None) -> EncoderStates:
        """The top layer's outputs h̄ (B, S, H) and every layer's final h and c (B, L, H)."""
        x = self.dropout(self.src_embed(src_ids))
        memory, final = run_encoder(self.encoder, x, src_pad)
        assert isinstance(final, tuple)
        h, c = final  # (L, B, H) each
        return EncoderStates(memory, [h.transpose(0, 1), c.transpose(0, 1)])

    def _teacher_forced(
        self, src_ids: Tensor, src_pad: Tensor | None, tgt_in: Tensor
    ) -> tuple[Tensor, Tensor]:
        cache = self._start(self.encode(src_ids, src_pad), src_pad, tgt_in.size(1), 1)
        if self.input_feeding:  # h̃_{t-1} is an input of step t: one step at a time
            steps = [self._step(tgt_in[:, t], cache) for t in range(tgt_in.size(1))]
            hidden, weights = (torch.stack(parts, 1) for parts in zip(*steps, strict=True))
            return hidden, weights
        h, c = (state.transpose(0, 1).contiguous() for state in cache.states)  # (L, B, H)
        top, _ = self.decoder(self.dropout(self.tgt_embed(tgt_in)), (h, c))  # (B, T, H)
        return self._attend(top, cache)

    def _step(self, tokens: Tensor, cache: RNNCache) -> tuple[Tensor, Tensor]:
        """h̃_t (rows, d_model) and a_t (rows, S) for ``tokens`` (rows,) = y_{t-1}."""
        x = self.dropout(self.tgt_embed(tokens))  # (rows, m)
        h, c = (state.transpose(0, 1).contiguous() for state in cache.states[:2])
        if self.input_feeding:
            x = torch.cat([x, cache.states[2]], dim=-1)
        top, (h, c) = self.decoder(x[:, None], (h, c))  # (rows, 1, H); (L, rows, H)
        sentences = cache.memory.size(0)
        hidden, weights = self._attend(top.view(sentences, -1, top.size(-1)), cache)
        hidden, weights = hidden.flatten(0, 1), weights.flatten(0, 1)
        cache.states = [h.transpose(0, 1), c.transpose(0, 1)]
        if self.input_feeding:
            cache.states.append(hidden)
        return hidden, weights

    def _attend(self, top: Tensor, cache: RNNCache) -> tuple[Tensor, Tensor]:
        """h̃ (N, K, d_model) and a (N, K, S) for top decoder states h_t (N, K, H)."""
        context, weights = self.attention(top, cache.keys, cache.memory, cache.src_pad)
        hidden = torch.tanh(self.combine(torch.cat([context, top], dim=-1)))
        return self.dropout(hidden), weights

    # -- incremental decoding --------------------------------------------------------------

    def _start(
        self, encoded: EncoderStates, src_pad: Tensor | None, max_len: int, beam_size: int
    ) -> RNNCache:
        states = [state.repeat_interleave(beam_size, 0) for state in encoded.final]
        if self.input_feeding:
            rows = states[0].size(0)
            states.append(states[0].new_zeros(rows, self.config.d_model))  # h̃_0
        memory = encoded.memory
        keys = self.attention.keys(memory)
        return RNNCache(memory, keys, src_pad, states, 0, max_len, beam_size)

    def step_hidden(self, tokens: Tensor, cache: RNNCache) -> Tensor:
        """h̃_t (rows, d_model) for ``tokens`` (rows,) = y_{t-1}; advances the cache."""
        _check_room(cache)
        hidden = self._step(tokens, cache)[0]
        cache.length += 1
        return hidden


def _check_room(cache: RNNCache) -> None:
    if cache.length >= cache.max_len:
        raise ValueError(f"cache is full ({cache.max_len} positions)")


RNNModel = RNNSearch | LuongNMT

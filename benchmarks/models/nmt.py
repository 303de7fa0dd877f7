"""LSTM encoder-decoder translation models with attention, teacher forced.

Inputs: ``(src_tokens, tgt_tokens)``, int64 ``(batch, src_len)`` and ``(batch, tgt_len)``.
Output: logits ``(batch, tgt_len, tgt_vocab)``.

Attention is Luong-style ("general" score) computed AFTER the decoder LSTM stack over all
target steps at once: ``scores = dec @ (W_a enc)^T`` (bmm), softmax over source
positions, ``context = attn @ enc`` (bmm), ``tanh(Linear([context, dec]))``, then the
vocabulary Linear. This is a SIMPLIFICATION of GNMT's input-feeding (recurrent)
attention, where the attention context of step t-1 feeds the decoder at step t; it keeps
the model traceable without a Python loop over time steps while keeping the same
parameter-carrying layers and roughly the same FLOPs.

Each LSTM layer is its own single-layer ``nn.LSTM`` (``encoder`` / ``decoder``
ModuleLists) so a planner can place or pipeline layers separately.

- ``nmt``: FlexFlow's NMT (Jia, Zaharia, Aiken, SysML 2019, Table 3: 4 recurrent layers,
  WMT English-German): 2 encoder + 2 decoder LSTM layers, the decoder initialised with the
  encoder's final states; sizes (approx.) from FlexFlow's original artifact
  (``nmt/nmt.cc``: hidden = embedding = 2048, vocabulary 20K, 40 steps in ``rnn.h``).
- ``gnmt8`` / ``gnmt16``: PipeDream's GNMT (Narayanan et al., SOSP 2019; the MLPerf /
  NVIDIA GNMT-v2 model of Wu et al. 2016): 4+4 / 8+8 LSTM layers of 1024, first encoder
  layer bidirectional, residual connections from layer 3 on, shared 32,320-token BPE
  vocabulary (separate source and target embedding tables here), sequences of 50 tokens
  (MLPerf max training length, approx.), decoder starting from zero state.

Model-file convention (DESIGN.md section 3): every builder returns
``(nn.Module, example_inputs)``; dim 0 of the inputs is the global batch of one training
iteration. ``build_model()`` is the headline configuration (GNMT-8).

Self-contained on purpose (files are loaded by path): imports only torch.
"""

from __future__ import annotations

import torch
from torch import nn

# FlexFlow and PipeDream both train with a fixed per-GPU minibatch (64 for FlexFlow's NMT
# and for PipeDream's GNMT, approx.) and scale it with the number of GPUs; the global
# batches below are that per-GPU batch x 16 GPUs (FlexFlow's P100 cluster: 4 nodes x 4;
# PipeDream's Cluster-A: 4 x 4 V100, Cluster-B: 2 x 8 V100).
PER_GPU_BATCH = 64
GPUS = 16


class Seq2Seq(nn.Module):
    def __init__(
        self,
        src_vocab: int,
        tgt_vocab: int,
        embed: int,
        hidden: int,
        enc_layers: int,
        dec_layers: int,
        bidirectional_first: bool = False,
        residual_from: int | None = None,
        pass_state: bool = False,
        dropout: float = 0.0,
    ) -> None:
        """``residual_from``: 1-based layer index from which each LSTM layer gets a residual
        connection (GNMT: 3). ``pass_state``: initialise decoder layer i with the final
        (h, c) of encoder layer i (needs equal depths and a unidirectional encoder)."""
        super().__init__()
        if pass_state and (enc_layers != dec_layers or bidirectional_first):
            raise ValueError("pass_state needs equal depths and a unidirectional encoder")
        self.pass_state = pass_state
        self.src_embedding = nn.Embedding(src_vocab, embed)
        self.tgt_embedding = nn.Embedding(tgt_vocab, embed)
        self.dropout = nn.Dropout(dropout)

        enc = []
        for i in range(enc_layers):
            if i == 0:
                enc.append(
                    nn.LSTM(embed, hidden, batch_first=True, bidirectional=bidirectional_first)
                )
            else:
                cin = 2 * hidden if (i == 1 and bidirectional_first) else hidden
                enc.append(nn.LSTM(cin, hidden, batch_first=True))
        self.encoder = nn.ModuleList(enc)
        self.decoder = nn.ModuleList(
            [
                nn.LSTM(embed if i == 0 else hidden, hidden, batch_first=True)
                for i in range(dec_layers)
            ]
        )
        first_res = residual_from if residual_from is not None else max(enc_layers, dec_layers) + 1
        # Residual layers must map hidden -> hidden.
        self.enc_residual = [i + 1 >= first_res for i in range(enc_layers)]
        self.dec_residual = [i + 1 >= first_res for i in range(dec_layers)]
        for i, r in enumerate(self.enc_residual):
            if r and (i == 0 or (i == 1 and bidirectional_first)):
                raise ValueError("residual connections need hidden-sized inputs")
        if any(self.dec_residual[:1]) and embed != hidden:
            raise ValueError("residual on decoder layer 1 needs embed == hidden")

        self.attn_key = nn.Linear(hidden, hidden, bias=False)  # Luong "general" score
        self.attn_combine = nn.Linear(2 * hidden, hidden)
        self.attn_tanh = nn.Tanh()
        self.classifier = nn.Linear(hidden, tgt_vocab)

    def forward(self, src_tokens: torch.Tensor, tgt_tokens: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.src_embedding(src_tokens))
        states = []
        for i, lstm in enumerate(self.encoder):
            y, state = lstm(x)
            states.append(state)
            x = y + x if self.enc_residual[i] else y
            if i + 1 < len(self.encoder):
                x = self.dropout(x)
        enc_out = x  # (B, S, H)

        d = self.dropout(self.tgt_embedding(tgt_tokens))
        for i, lstm in enumerate(self.decoder):
            y, _ = lstm(d, states[i]) if self.pass_state else lstm(d)
            d = y + d if self.dec_residual[i] else y
            if i + 1 < len(self.decoder):
                d = self.dropout(d)
        dec_out = d  # (B, T, H)

        keys = self.attn_key(enc_out)  # (B, S, H)
        scores = torch.bmm(dec_out, keys.transpose(1, 2))  # (B, T, S)
        attn = torch.softmax(scores, dim=-1)
        context = torch.bmm(attn, enc_out)  # (B, T, H)
        h = self.attn_tanh(self.attn_combine(torch.cat([context, dec_out], dim=-1)))
        return self.classifier(self.dropout(h))


def _tokens(src_vocab: int, tgt_vocab: int, batch: int, src_len: int, tgt_len: int):
    src = torch.randint(0, src_vocab, (batch, src_len))
    tgt = torch.randint(0, tgt_vocab, (batch, tgt_len))
    return src, tgt


def nmt(
    batch_size: int = PER_GPU_BATCH * GPUS,
    src_len: int = 40,
    tgt_len: int = 40,
    vocab: int = 20480,
    hidden: int = 2048,
    dropout: float = 0.0,
):
    """FlexFlow's NMT (SysML 2019): 2 encoder + 2 decoder LSTM layers of 2048, embeddings 2048,
    vocabularies 20480, attention, 40-token sequences (~268M parameters); global batch
    1024 = 64 per GPU x 16 GPUs (approx.). Built on meta."""
    with torch.device("meta"):
        model = Seq2Seq(vocab, vocab, hidden, hidden, 2, 2, pass_state=True, dropout=dropout)
        inputs = _tokens(vocab, vocab, batch_size, src_len, tgt_len)
    return model, inputs


def _gnmt(layers: int, batch_size: int, seq_len: int, vocab: int, hidden: int, dropout: float):
    half = layers // 2
    with torch.device("meta"):
        model = Seq2Seq(
            vocab,
            vocab,
            hidden,
            hidden,
            half,
            half,
            bidirectional_first=True,
            residual_from=3,
            dropout=dropout,
        )
        inputs = _tokens(vocab, vocab, batch_size, seq_len, seq_len)
    return model, inputs


def gnmt8(
    batch_size: int = PER_GPU_BATCH * GPUS,
    seq_len: int = 50,
    vocab: int = 32320,
    hidden: int = 1024,
    dropout: float = 0.2,
):
    """GNMT-8 as in PipeDream (SOSP 2019): 4 encoder (first bidirectional) + 4 decoder LSTM
    layers of 1024, residuals from layer 3, vocab 32320, 50 tokens, dropout 0.2 (~182M
    parameters); global batch 1024 = PipeDream's 64 per GPU x 16 GPUs (approx.).
    Built on meta."""
    return _gnmt(8, batch_size, seq_len, vocab, hidden, dropout)


def gnmt16(
    batch_size: int = PER_GPU_BATCH * GPUS,
    seq_len: int = 50,
    vocab: int = 32320,
    hidden: int = 1024,
    dropout: float = 0.2,
):
    """GNMT-16 as in PipeDream (SOSP 2019): 8 encoder (first bidirectional) + 8 decoder LSTM
    layers of 1024, residuals from layer 3, vocab 32320, 50 tokens, dropout 0.2 (~249M
    parameters); global batch 1024 = PipeDream's 64 per GPU x 16 GPUs (approx.).
    Built on meta."""
    return _gnmt(16, batch_size, seq_len, vocab, hidden, dropout)


def nmt_tiny(batch_size: int = 4, src_len: int = 10, tgt_len: int = 12):
    """Tiny GNMT-style model for equivalence tests: 3 encoder (first bidirectional) + 3
    decoder LSTM layers of 32, residual on layer 3, embeddings 16, vocabularies 50/60,
    src 10 / tgt 12 tokens, batch 4, dropout 0."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Seq2Seq(50, 60, 16, 32, 3, 3, bidirectional_first=True, residual_from=3)
        inputs = _tokens(50, 60, batch_size, src_len, tgt_len)
    return model, inputs


def build_model():
    """Headline configuration: :func:`gnmt8`."""
    return gnmt8()

"""Recurrent language models from the FlexFlow paper's benchmarks (Jia, Zaharia, Aiken,
"Beyond Data and Model Parallelism for Deep Neural Networks", SysML 2019, Table 3).

- RNNTC, text classification (Movie Reviews): Embedding -> 4 stacked LSTM layers ->
  Linear over the last layer's final hidden state -> class logits ``(batch, classes)``.
- RNNLM, language modelling (Penn Treebank): Embedding -> 2 stacked LSTM layers ->
  Linear to the vocabulary at every step -> logits ``(batch, seq, vocab)``.

Each LSTM layer is its own single-layer ``nn.LSTM`` (ModuleList ``lstms``) so a planner
can place layers separately, as FlexFlow does. Sizes (approx.): hidden = embedding = 2048,
40 unrolled steps, following the defaults of FlexFlow's original RNN/NMT artifact
(``nmt/nmt.cc``: hidden 2048, embed 2048, vocab 20K; ``rnn.h``: 40 steps); vocabularies:
PTB 10,000 words, Movie Reviews 20,480 (approx.).

Model-file convention (DESIGN.md section 3): every builder returns
``(nn.Module, example_inputs)``; dim 0 of the inputs is the global batch of one training
iteration. ``build_model()`` is the headline configuration (RNNLM).

Self-contained on purpose (files are loaded by path): imports only torch.
"""

from __future__ import annotations

import torch
from torch import nn

# FlexFlow trains with a fixed per-GPU batch (64, approx.); global batch = per-GPU batch
# x the 16 GPUs of its P100 cluster (4 nodes x 4 GPUs).
FLEXFLOW_PER_GPU_BATCH = 64
FLEXFLOW_GPUS = 16


def _lstm_stack(embed: int, hidden: int, layers: int) -> nn.ModuleList:
    return nn.ModuleList(
        [nn.LSTM(embed if i == 0 else hidden, hidden, batch_first=True) for i in range(layers)]
    )


class RNNTextClassifier(nn.Module):
    def __init__(
        self, vocab: int, embed: int, hidden: int, layers: int, classes: int, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstms = _lstm_stack(embed, hidden, layers)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        h = None
        for lstm in self.lstms:
            x, (h, _) = lstm(x)
        # h: (1, batch, hidden), the last layer's hidden state after the last step.
        return self.fc(self.dropout(h[0]))


class RNNLanguageModel(nn.Module):
    def __init__(
        self, vocab: int, embed: int, hidden: int, layers: int, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstms = _lstm_stack(embed, hidden, layers)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for lstm in self.lstms:
            x, _ = lstm(x)
        return self.fc(self.dropout(x))


def rnntc(
    batch_size: int = FLEXFLOW_PER_GPU_BATCH * FLEXFLOW_GPUS,
    seq_len: int = 40,
    vocab: int = 20480,
    hidden: int = 2048,
    layers: int = 4,
):
    """RNNTC (FlexFlow, SysML 2019): Embedding(20480, 2048) -> 4 x LSTM(2048) -> Linear(2048, 2)
    (176M parameters), 40 steps, global batch 1024 = 64 per GPU x 16 GPUs (approx.).
    Built on meta."""
    with torch.device("meta"):
        model = RNNTextClassifier(vocab, hidden, hidden, layers, classes=2)
        tokens = torch.randint(0, vocab, (batch_size, seq_len))
    return model, (tokens,)


def rnnlm(
    batch_size: int = FLEXFLOW_PER_GPU_BATCH * FLEXFLOW_GPUS,
    seq_len: int = 40,
    vocab: int = 10000,
    hidden: int = 2048,
    layers: int = 2,
):
    """RNNLM (FlexFlow, SysML 2019): Embedding(10000, 2048) -> 2 x LSTM(2048) ->
    Linear(2048, 10000) (108M parameters), 40 steps, global batch 1024 = 64 per GPU x 16
    GPUs (approx.). Built on meta."""
    with torch.device("meta"):
        model = RNNLanguageModel(vocab, hidden, hidden, layers)
        tokens = torch.randint(0, vocab, (batch_size, seq_len))
    return model, (tokens,)


def rnntc_tiny(batch_size: int = 8, seq_len: int = 12):
    """Tiny RNNTC for equivalence tests: vocab 100, embed 16, 2 x LSTM(32), 2 classes,
    seq 12, batch 8."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = RNNTextClassifier(100, 16, 32, 2, classes=2)
        tokens = torch.randint(0, 100, (batch_size, seq_len))
    return model, (tokens,)


def rnnlm_tiny(batch_size: int = 8, seq_len: int = 12):
    """Tiny RNNLM for equivalence tests: vocab 100, embed 16, 2 x LSTM(32), seq 12, batch 8."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = RNNLanguageModel(100, 16, 32, 2)
        tokens = torch.randint(0, 100, (batch_size, seq_len))
    return model, (tokens,)


def build_model():
    """Headline configuration: :func:`rnnlm`."""
    return rnnlm()

"""BERT encoder with the masked-language-model head (pre-training shape).

Structure: word + position + segment (token type) Embedding, LayerNorm, Dropout ->
``layers`` (ModuleList of post-LN encoder layers: fused qkv Linear +
``F.scaled_dot_product_attention`` (bidirectional, no padding mask) + output Linear,
residual, LayerNorm; Linear-GELU-Linear, residual, LayerNorm) -> MLM head (Linear,
GELU, LayerNorm, decoder Linear whose weight is tied to the word embedding, plus a
bias). Returns MLM logits ``(batch, seq, vocab)``. The pooler and next-sentence head
are left out (their parameters would be unused by the MLM output).

Inputs: ``(input_ids, token_type_ids)``, both ``(batch, seq)`` int64.

Model-file convention (DESIGN.md section 3): every builder returns
``(nn.Module, example_inputs)``; dim 0 of the inputs is the global batch of one
training iteration. ``build_model()`` is the headline configuration (BERT-large).

Self-contained on purpose (files are loaded by path): imports only torch/dataclasses.
"""

# No `from __future__ import annotations`: with string annotations, @dataclass looks the
# module up in sys.modules, which a file loaded by path with importlib may not be in.
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    max_position: int = 512
    type_vocab_size: int = 2
    n_layer: int = 24
    n_head: int = 16
    d_model: int = 1024
    d_ff: int = 4096
    dropout: float = 0.1
    eps: float = 1e-12


class SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.d_model = cfg.d_model
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(self.d_model, dim=2)
        q = q.unflatten(2, (self.n_head, self.head_dim)).transpose(1, 2)
        k = k.unflatten(2, (self.n_head, self.head_dim)).transpose(1, 2)
        v = v.unflatten(2, (self.n_head, self.head_dim)).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0
        )
        return self.out(y.transpose(1, 2).flatten(2))


class EncoderLayer(nn.Module):
    """Post-LN transformer encoder layer (as in BERT / the original Transformer)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_ff)
        self.gelu = nn.GELU()
        self.fc_out = nn.Linear(cfg.d_ff, cfg.d_model)
        self.ffn_dropout = nn.Dropout(cfg.dropout)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(x + self.attn_dropout(self.attn(x)))
        x = self.ln_2(x + self.ffn_dropout(self.fc_out(self.gelu(self.fc_in(x)))))
        return x


class BertForMaskedLM(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.position_embeddings = nn.Embedding(cfg.max_position, cfg.d_model)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.d_model)
        self.emb_ln = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList([EncoderLayer(cfg) for _ in range(cfg.n_layer)])
        # MLM head ("cls.predictions" in the reference implementation).
        self.mlm_dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.mlm_gelu = nn.GELU()
        self.mlm_ln = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
        self.mlm_decoder = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.mlm_decoder.weight = self.word_embeddings.weight  # tied, as in BERT

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.size(1), dtype=torch.long, device=input_ids.device)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(pos)
            + self.token_type_embeddings(token_type_ids)
        )
        x = self.emb_dropout(self.emb_ln(x))
        for layer in self.layers:
            x = layer(x)
        x = self.mlm_ln(self.mlm_gelu(self.mlm_dense(x)))
        return self.mlm_decoder(x)


def _inputs(cfg: BertConfig, batch_size: int, seq_len: int):
    input_ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    token_type_ids = torch.randint(0, cfg.type_vocab_size, (batch_size, seq_len))
    return input_ids, token_type_ids


def bert_large(batch_size: int = 256, seq_len: int = 512, dropout: float = 0.1):
    """BERT-large (335M with the MLM head): 24 layers, d=1024, 16 heads, FFN 4096, vocab 30522.

    Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers":
    batch 256 sequences x 512 tokens (128,000 tokens/batch); the paper runs 90% of the
    steps at sequence length 128 (pass ``seq_len=128`` for that phase). Dropout 0.1 as the
    paper. Built on meta.
    """
    cfg = BertConfig(dropout=dropout)
    with torch.device("meta"):
        model = BertForMaskedLM(cfg)
        inputs = _inputs(cfg, batch_size, seq_len)
    return model, inputs


def bert_tiny(batch_size: int = 8, seq_len: int = 32):
    """Tiny BERT for equivalence tests: 2 layers, d=64, 4 heads, FFN 256, vocab 512, seq 32,
    batch 8, dropout 0."""
    cfg = BertConfig(
        vocab_size=512, max_position=32, n_layer=2, n_head=4, d_model=64, d_ff=256, dropout=0.0
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BertForMaskedLM(cfg)
        inputs = _inputs(cfg, batch_size, seq_len)
    return model, inputs


def build_model():
    """Headline configuration: :func:`bert_large`."""
    return bert_large()

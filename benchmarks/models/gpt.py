"""GPT decoder-only transformers (nanoGPT-style GPT-2 / GPT-3 layout).

Structure: token ``wte`` + position ``wpe`` Embedding -> ``h`` (ModuleList of pre-LN
blocks: LayerNorm, causal self-attention with one fused ``c_attn`` qkv Linear +
``F.scaled_dot_product_attention(is_causal=True)`` + ``c_proj`` Linear, LayerNorm,
MLP Linear-GELU-Linear) -> final LayerNorm ``ln_f`` -> ``lm_head`` Linear whose weight
is TIED to ``wte.weight`` (as in GPT-2). Returns logits ``(batch, seq, vocab)``.

Model-file convention (DESIGN.md section 3): every builder returns
``(nn.Module, example_inputs)``; dim 0 of the inputs is the global batch of one
training iteration. Configurations above ~100M parameters are built on the meta
device (no memory). ``build_model()`` is the headline configuration (GPT-2 small).

Self-contained on purpose (files are loaded by path): imports only torch/dataclasses.
"""

# No `from __future__ import annotations`: with string annotations, @dataclass looks the
# module up in sys.modules, which a file loaded by path with importlib may not be in.
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    fused_qkv: bool = True
    """One ``c_attn`` Linear for q, k and v (GPT-2's layout: a column split of it is not
    aligned with the heads); False: ``q_proj``, ``k_proj``, ``v_proj`` (Megatron's and
    torchtitan's head-aligned layout for tensor parallelism; the same FLOPs)."""
    fused_attention: bool = True
    """``F.scaled_dot_product_attention`` (a fused kernel: FlashAttention on GPUs);
    False: attention as it ran before fused kernels (Megatron-LM's SC21 runs, nanoGPT's
    fallback): the ``(batch, heads, T, T)`` scores materialised by ``q k^T``, a causal
    mask, softmax, dropout, then ``@ v`` (the same result, more memory traffic)."""


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head != 0:
            raise ValueError("n_embd must be divisible by n_head")
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.n_embd = cfg.n_embd
        self.dropout = cfg.dropout
        self.fused_attention = cfg.fused_attention
        if not cfg.fused_attention:
            self.attn_dropout = nn.Dropout(cfg.dropout)
        if cfg.fused_qkv:
            self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        else:
            self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
            self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
            self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "c_attn"):
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # (B, T, C) -> (B, nh, T, hd); unflatten keeps shapes out of Python.
        q = q.unflatten(2, (self.n_head, self.head_dim)).transpose(1, 2)
        k = k.unflatten(2, (self.n_head, self.head_dim)).transpose(1, 2)
        v = v.unflatten(2, (self.n_head, self.head_dim)).transpose(1, 2)
        if self.fused_attention:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        else:
            scores = (q * self.head_dim**-0.5) @ k.transpose(-2, -1)
            causal = torch.ones(x.size(1), x.size(1), dtype=torch.bool, device=x.device).tril()
            y = self.attn_dropout(scores.masked_fill(~causal, float("-inf")).softmax(-1)) @ v
        y = y.transpose(1, 2).flatten(2)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Weight tying, as GPT-2: the output projection reuses the token embedding.
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x)


def _build(cfg: GPTConfig, batch_size: int, seq_len: int, meta: bool):
    if seq_len > cfg.block_size:
        raise ValueError("seq_len exceeds block_size")
    if meta:
        with torch.device("meta"):
            model = GPT(cfg)
            idx = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
        return model, (idx,)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    return model, (idx,)


def gpt2_small(batch_size: int = 512, seq_len: int = 1024, dropout: float = 0.0, vocab_size: int = 50257):
    """GPT-2 small (124M): 12 layers, d=768, 12 heads, vocab 50257, context 1024.

    Radford et al. 2019, "Language Models are Unsupervised Multitask Learners":
    batch 512 sequences of 1024 tokens. Built on meta. ``vocab_size=50304`` is nanoGPT's
    padding of the vocabulary to a multiple of 64 (its GEMMs' dimensions aligned).
    """
    cfg = GPTConfig(n_layer=12, n_head=12, n_embd=768, dropout=dropout, vocab_size=vocab_size)
    return _build(cfg, batch_size, seq_len, meta=True)


def gpt2_medium(batch_size: int = 512, seq_len: int = 1024, dropout: float = 0.0):
    """GPT-2 medium (355M): 24 layers, d=1024, 16 heads, vocab 50257, context 1024.

    Radford et al. 2019 (GPT-2 paper): batch 512 x 1024 tokens. Built on meta.
    """
    cfg = GPTConfig(n_layer=24, n_head=16, n_embd=1024, dropout=dropout)
    return _build(cfg, batch_size, seq_len, meta=True)


def gpt2_xl(batch_size: int = 512, seq_len: int = 1024, dropout: float = 0.0):
    """GPT-2 XL (1.56B): 48 layers, d=1600, 25 heads, vocab 50257, context 1024.

    Radford et al. 2019 (GPT-2 paper): batch 512 x 1024 tokens. Built on meta.
    """
    cfg = GPTConfig(n_layer=48, n_head=25, n_embd=1600, dropout=dropout)
    return _build(cfg, batch_size, seq_len, meta=True)


def gpt3_175b(batch_size: int = 1536, seq_len: int = 2048, dropout: float = 0.0):
    """GPT-3 175B: 96 layers, d=12288, 96 heads (head dim 128), context 2048, vocab 50257.

    Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1: batch 3.2M
    tokens = ~1536 sequences of 2048. Dense attention everywhere (GPT-3 alternates dense
    and locally banded sparse layers; the sparse pattern is not modelled). Built on meta.
    """
    cfg = GPTConfig(block_size=2048, n_layer=96, n_head=96, n_embd=12288, dropout=dropout)
    return _build(cfg, batch_size, seq_len, meta=True)


def gpt_tiny(batch_size: int = 8, seq_len: int = 32):
    """Tiny GPT for equivalence tests: 2 layers, d=64, 4 heads, vocab 512, seq 32, batch 8."""
    cfg = GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.0)
    return _build(cfg, batch_size, seq_len, meta=False)


def build_model():
    """Headline configuration: :func:`gpt2_small`."""
    return gpt2_small()

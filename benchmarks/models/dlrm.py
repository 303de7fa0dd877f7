"""DLRM (Naumov et al., "Deep Learning Recommendation Model for Personalization and
Recommendation Systems", 2019), the MLPerf Training configuration on Criteo Terabyte.

dense features -> bottom MLP (Linear+ReLU layers) -> x (batch, d);
each categorical feature i -> EmbeddingBag(rows_i, d, mode="sum") on a bag of one index
(Criteo features are one-hot) -> e_i (batch, d);
T = stack([x, e_1..e_k]) (batch, k+1, d); Z = T @ T^T; keep the strictly lower triangle
(pairwise dot products, no self-interaction) -> concat with x -> top MLP (Linear+ReLU,
no activation after the last layer). Returns the click logit (batch, 1); the sigmoid /
BCE belong to the loss.

Inputs: ``(dense, sparse)``: float ``(batch, 13)`` and int64 ``(batch, 26)``, column i
indexing table i.

Model-file convention (DESIGN.md section 3): every builder returns
``(nn.Module, example_inputs)``; dim 0 of the inputs is the global batch of one training
iteration. ``build_model()`` is the headline configuration.

Self-contained on purpose (files are loaded by path): imports only torch.
"""

from __future__ import annotations

import torch
from torch import nn

# Criteo Terabyte categorical cardinalities with MLPerf's --max-ind-range=40000000
# (facebookresearch/dlrm, dlrm_s_pytorch.py / bench/run_and_time.sh).
CRITEO_TB_40M_ROWS = (
    39884406,
    39043,
    17289,
    7420,
    20263,
    3,
    7120,
    1543,
    63,
    38532951,
    2953546,
    403346,
    10,
    2208,
    11938,
    155,
    4,
    976,
    14,
    39979771,
    25641295,
    39664984,
    585935,
    12972,
    108,
    36,
)


def _mlp(dims: tuple[int, ...], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(
        self,
        num_dense: int,
        table_rows: tuple[int, ...],
        dim: int,
        bottom: tuple[int, ...],
        top: tuple[int, ...],
    ) -> None:
        """``bottom``: hidden sizes after the dense input, the last one must equal ``dim``.
        ``top``: sizes after the interaction output, ending with 1."""
        super().__init__()
        if bottom[-1] != dim:
            raise ValueError("the bottom MLP must end at the embedding dim")
        self.num_features = len(table_rows) + 1
        self.bottom_mlp = _mlp((num_dense, *bottom), last_relu=True)
        self.embeddings = nn.ModuleList(
            [nn.EmbeddingBag(rows, dim, mode="sum") for rows in table_rows]
        )
        interactions = self.num_features * (self.num_features - 1) // 2
        self.top_mlp = _mlp((dim + interactions, *top), last_relu=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bottom_mlp(dense)
        feats = [x]
        for i, emb in enumerate(self.embeddings):
            feats.append(emb(sparse[:, i : i + 1]))  # one bag of one index per sample
        t = torch.stack(feats, dim=1)  # (B, F, d)
        z = torch.bmm(t, t.transpose(1, 2))  # (B, F, F)
        n = self.num_features
        tri = torch.tril_indices(n, n, offset=-1, device=z.device)  # (2, F(F-1)/2)
        r = torch.cat([x, z[:, tri[0], tri[1]]], dim=1)  # (B, d + F(F-1)/2)
        return self.top_mlp(r)


def _inputs(num_dense: int, table_rows, batch: int):
    dense = torch.rand(batch, num_dense)
    sparse = torch.stack([torch.randint(0, rows, (batch,)) for rows in table_rows], dim=1)
    return dense, sparse


def dlrm(batch_size: int = 2048):
    """DLRM, MLPerf Training / Criteo Terabyte: 13 dense features, bottom MLP 13-512-256-128,
    26 EmbeddingBag tables (rows capped at 40M, 188M rows in all) of dim 128, dot-product
    interaction, top MLP 479-1024-1024-512-256-1 (24.0B parameters), batch 2048 as the
    MLPerf reference run (facebookresearch/dlrm bench/run_and_time.sh,
    --mini-batch-size=2048). Built on meta."""
    with torch.device("meta"):
        model = DLRM(13, CRITEO_TB_40M_ROWS, 128, (512, 256, 128), (1024, 1024, 512, 256, 1))
        inputs = _inputs(13, CRITEO_TB_40M_ROWS, batch_size)
    return model, inputs


def dlrm_tiny(batch_size: int = 16):
    """Tiny DLRM for equivalence tests: 13 dense features, bottom 13-16-8, 4 tables
    (50/40/30/20 rows) of dim 8, top 18-16-1, batch 16."""
    rows = (50, 40, 30, 20)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DLRM(13, rows, 8, (16, 8), (16, 1))
        inputs = _inputs(13, rows, batch_size)
    return model, inputs


def build_model():
    """Headline configuration: :func:`dlrm`."""
    return dlrm()

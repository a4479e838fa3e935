"""The demo's task and model, shared by ``train.py`` and ``evaluate.py``.

The data is an order-2 Markov chain over ``VOCAB`` symbols: each next symbol is drawn from a fixed
random distribution given the two before it. The best possible loss is known exactly (the chain's
own probabilities), and the targets are random, so minibatch gradients stay noisy however long
training runs: the setting where averaging weights over time pays off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 16
SEQ_LEN = 32
SOURCE_SEED = 1234
HELD_OUT_SEED = 999_999


def markov_table(seed: int = SOURCE_SEED) -> torch.Tensor:
    """P(next | prev2, prev1) as a [VOCAB, VOCAB, VOCAB] table, each row peaked on a few symbols."""
    g = torch.Generator().manual_seed(seed)
    return (2.5 * torch.randn(VOCAB, VOCAB, VOCAB, generator=g)).softmax(-1)


def sample(table: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` sequences of ``SEQ_LEN + 1`` symbols from the chain (int64, [n, SEQ_LEN + 1])."""
    seq = torch.empty(n, SEQ_LEN + 1, dtype=torch.long)
    seq[:, :2] = torch.randint(0, VOCAB, (n, 2), generator=generator)
    for t in range(2, SEQ_LEN + 1):
        probs = table[seq[:, t - 2], seq[:, t - 1]]
        seq[:, t] = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return seq


def held_out(n: int = 2048) -> torch.Tensor:
    """The evaluation sequences: never seen in training (their own seed)."""
    return sample(markov_table(), n, torch.Generator().manual_seed(HELD_OUT_SEED))


def lm_loss(logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the predictions of symbols 2..SEQ_LEN (each has two symbols of context)."""
    return F.cross_entropy(logits[:, 1:].reshape(-1, VOCAB), seq[:, 2:].reshape(-1))


def floor_loss(table: torch.Tensor, seq: torch.Tensor) -> float:
    """The loss of the chain's true probabilities on ``seq``: no model can beat it on average."""
    probs = table[seq[:, :-2], seq[:, 1:-1], seq[:, 2:]]
    return float(-probs.log().mean())


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyTransformer(nn.Module):
    """Token and position embeddings, causal transformer blocks, a final norm and an output head."""

    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ_LEN, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

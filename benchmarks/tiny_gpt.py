"""A tiny GPT (decoder-only transformer) used as the training workload.

Deliberately small and dependency-free: token + position embeddings, ``n_layer`` pre-norm
blocks (causal self-attention through ``scaled_dot_product_attention`` and a 4x GELU MLP),
a final LayerNorm and an LM head tied to the token embedding. The presets are sized so that
one iteration takes a fraction of a second on a 2-core CPU, which makes checkpoint cost
visible against compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model and of one training batch."""

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    block_size: int
    batch_size: int

    def param_count(self) -> int:
        """Number of parameters (the LM head is tied to the token embedding)."""
        emb = self.vocab_size * self.n_embd + self.block_size * self.n_embd
        per_block = 12 * self.n_embd * self.n_embd + 13 * self.n_embd
        return emb + self.n_layer * per_block + 2 * self.n_embd


PRESETS: dict[str, GPTConfig] = {
    # ~0.2 M parameters: for --quick and CI.
    "tiny": GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=1024, block_size=64, batch_size=4),
    # ~5 M parameters (~65 MB checkpoint with AdamW state), batch 4 x 128 tokens.
    "small": GPTConfig(
        n_layer=4, n_head=8, n_embd=256, vocab_size=8192, block_size=128, batch_size=4
    ),
    # ~30 M parameters (~360 MB checkpoint with AdamW state).
    "medium": GPTConfig(
        n_layer=6, n_head=8, n_embd=512, vocab_size=16384, block_size=128, batch_size=8
    ),
    # ~185 M parameters (~2.2 GB checkpoint with AdamW state), batch 16 x 512 tokens: for GPUs.
    "large": GPTConfig(
        n_layer=12, n_head=16, n_embd=1024, vocab_size=32768, block_size=512, batch_size=16
    ),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying, as in GPT-2
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                scale = std / math.sqrt(2 * cfg.n_layer) if name.endswith("proj.weight") else std
                nn.init.normal_(p, mean=0.0, std=scale)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Return the mean cross-entropy loss of next-token prediction."""
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def random_batch(
    cfg: GPTConfig, generator: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of random tokens (inputs and shifted targets); content does not matter here."""
    data = torch.randint(
        0, cfg.vocab_size, (cfg.batch_size, cfg.block_size + 1), generator=generator
    )
    data = data.to(device)
    return data[:, :-1], data[:, 1:]

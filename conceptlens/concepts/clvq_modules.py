"""The trainable pieces of a `CLVQTranscoder`: its residual encoder and its two decoders.

    encoder = ResidualEncoder(d_src)                  # (N, d_src) -> (N, d_src)
    decoder = SequenceDecoder(d_src, 256, d_tgt, layers=2, heads=4, causal=True)
    x_hat = decoder(encoder(x_src), sequence_ids)     # (N, d_tgt)

The sequence decoder groups a flat batch of rows into padded sequences (`pad_sequences`)
and marks positions with `sinusoids`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn



ALPHA_START = 0.2
"""The encoder's alpha before training (CLVQ-VAE's released code: nn.Parameter(torch.tensor(0.2)))."""

class ResidualEncoder(nn.Module):
    """z_e = (1 - a) h + a LayerNorm(W h + b) with a = 0.5 sigmoid(alpha): (N, d) -> (N, d); alpha
    starts at `ALPHA_START`, as the paper's released code (a mix of 0.275)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.alpha = nn.Parameter(torch.tensor(ALPHA_START))

    @property
    def mix(self) -> Tensor:
        return 0.5 * torch.sigmoid(self.alpha)

    def forward(self, h: Tensor) -> Tensor:
        return (1 - self.mix) * h + self.mix * self.norm(self.linear(h))


class MLPDecoder(nn.Module):
    """Per-token decoder (N, d_in) -> (N, d_out); sequence_ids are ignored."""

    def __init__(self, d_in: int, hidden: int, d_out: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, d_out))

    def forward(self, z: Tensor, sequence_ids: Tensor | None = None) -> Tensor:
        return self.net(z)


class SequenceDecoder(nn.Module):
    """Transformer decoder over each sequence's codes: (N, d_in) -> (N, d_out).

    Rows are grouped by `sequence_ids` (N,), in their order within the batch (sinusoidal
    positions mark that order); each token attends to its sequence's codes, in self- and
    cross-attention (memory = the codes, straight-through z_q).
    """

    def __init__(self, d_in: int, hidden: int, d_out: int, layers: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.proj_in = nn.Linear(d_in, hidden)
        layer = nn.TransformerDecoderLayer(hidden, heads, 2 * hidden, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerDecoder(layer, layers)
        self.proj_out = nn.Linear(hidden, d_out)

    def forward(self, z: Tensor, sequence_ids: Tensor | None = None) -> Tensor:
        if sequence_ids is None:
            raise ValueError("the transformer decoder needs sequence_ids (N,) to group tokens into sequences")
        h, padding, where = pad_sequences(self.proj_in(z), sequence_ids)        # (S, L, h)
        length = h.shape[1]
        h = h + sinusoids(length, h.shape[2]).to(h)      # attention alone does not see order
        mask = torch.ones(length, length, dtype=torch.bool, device=z.device).triu(1) if self.causal else None
        h = self.blocks(h, h, tgt_mask=mask, memory_mask=mask, tgt_key_padding_mask=padding,
                        memory_key_padding_mask=padding)
        return self.proj_out(h[where])                                            # (N, d_out)


def pad_sequences(h: Tensor, sequence_ids: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """Group rows h (N, d) by sequence id, keeping their order within each sequence.

    Returns padded (S, L, d), padding mask (S, L) (True = padding), and (sequence, position)
    indices (N,), (N,) so that padded[sequence, position] == h.
    """
    _, seq, counts = torch.unique(sequence_ids, return_inverse=True, return_counts=True)
    order = torch.argsort(seq, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(seq)
    pos[order] = torch.arange(len(seq), device=h.device) - starts[seq[order]]
    padded = h.new_zeros(len(counts), int(counts.max()), h.shape[1])
    padded[seq, pos] = h
    padding = torch.arange(padded.shape[1], device=h.device)[None] >= counts[:, None]
    return padded, padding, (seq, pos)


def sinusoids(length: int, width: int) -> Tensor:
    """Sinusoidal position codes (length, width) of the original transformer."""
    pos = torch.arange(length, dtype=torch.float64)[:, None]
    freq = torch.exp(-torch.arange(0, width, 2, dtype=torch.float64) * (math.log(10_000.0) / width))
    out = torch.zeros(length, width, dtype=torch.float64)
    out[:, 0::2], out[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq[: width // 2])
    return out

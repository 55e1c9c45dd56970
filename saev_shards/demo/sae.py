"""A minimal top-k sparse autoencoder, enough to train from a cache in the demo, and the
same model as a transcoder.

The top-k SAE (Gao et al., 2024, "Scaling and evaluating sparse autoencoders") keeps the
``k`` largest latents per token, so sparsity needs no penalty to tune and the loss is
plain reconstruction error. Inputs are normalised with the cache's own statistics
(stats.json): ``(x - mean) / scale`` with ``scale = sqrt(mean(var))``, so the mean squared
error per dimension is the fraction of variance left unexplained.

A transcoder (Dunefsky et al., 2024) is the same model trained to predict an MLP's output
from its input: `train` with ``target`` takes batches ``(B, 2, D)`` of (input, output)
pairs, as a loader gives them from a cache of sites (``sites=[mlp input, mlp output]``).

torch is imported when this module is imported; ``import saev_shards`` never imports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypedDict, Unpack

import numpy as np
import torch


class TopKSAE(torch.nn.Module):
    """``x_hat = W_dec topk(relu(W_enc (x - b_dec) + b_enc)) + b_dec`` with unit-norm decoder rows."""

    def __init__(self, d_model: int, n_latents: int, k: int, seed: int = 0) -> None:
        super().__init__()
        if not 0 < k <= n_latents:
            raise ValueError(f"k must lie in [1, n_latents={n_latents}], found {k}")
        gen = torch.Generator().manual_seed(seed)
        w_dec = torch.randn(n_latents, d_model, generator=gen)
        w_dec /= w_dec.norm(dim=1, keepdim=True)
        self.w_dec = torch.nn.Parameter(w_dec)  # (n_latents, d_model)
        self.w_enc = torch.nn.Parameter(w_dec.t().clone())  # (d_model, n_latents): tied at init
        self.b_enc = torch.nn.Parameter(torch.zeros(n_latents))
        self.b_dec = torch.nn.Parameter(torch.zeros(d_model))
        self.k = k

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Sparse codes ``(B, n_latents)``: at most ``k`` non-zeros per row."""
        pre = torch.relu((x - self.b_dec) @ self.w_enc + self.b_enc)
        top = pre.topk(self.k, dim=-1)
        return torch.zeros_like(pre).scatter_(-1, top.indices, top.values)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.encode(x)
        return z @ self.w_dec + self.b_dec, z

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        """Rescale decoder rows to unit norm (keeps the latents' scale identifiable)."""
        self.w_dec.div_(self.w_dec.norm(dim=1, keepdim=True).clamp(min=1e-8))


def normaliser(stats: dict[str, Any], layer_index: int) -> tuple[torch.Tensor, float]:
    """``(mean, scale)`` for one recorded layer from a cache's `Shards.stats`."""
    mean = torch.as_tensor(np.asarray(stats["mean"][layer_index]), dtype=torch.float32)
    scale = float(np.sqrt(np.mean(stats["var"][layer_index])))
    return mean, scale


class Log(TypedDict, total=False):
    """How `train` reports: every ``log_every`` steps (default 25), a line passed to ``say``
    (default `print`)."""

    log_every: int
    say: Callable[[str], None]


def train(
    sae: TopKSAE,
    batches: Iterable[torch.Tensor],
    *,
    steps: int,
    mean: torch.Tensor,
    scale: float,
    lr: float = 1e-3,
    target: tuple[torch.Tensor, float] | None = None,
    **log: Unpack[Log],
) -> list[tuple[int, float]]:
    """Train on ``steps`` batches of raw activations; return ``(step, mean loss since last log)``.

    ``target`` ``(mean, scale)``: train a transcoder. Each batch is ``(B, 2, D)``: the input
    ``[:, 0]`` (normalised with ``mean`` and ``scale``) and the output to predict ``[:, 1]``
    (normalised with ``target``'s); the loss is the fraction of the output's variance left
    unexplained. ``log_every=`` and ``say=`` (`Log`): how often it reports, and to what."""
    unknown = sorted(set(log) - set(Log.__annotations__))
    if unknown:
        raise TypeError(f"train() got unexpected keyword arguments: {', '.join(unknown)}")
    log_every = log.get("log_every", 25)
    say = log.get("say", print)
    opt = torch.optim.Adam(sae.parameters(), lr=lr)
    history: list[tuple[int, float]] = []
    running, count = 0.0, 0
    t0 = time.perf_counter()
    seen = 0
    it: Iterator[torch.Tensor] = iter(batches)
    for step in range(1, steps + 1):
        batch = next(it).float()
        if target is None:
            x = y = (batch - mean) / scale
        else:
            if batch.ndim != 3 or batch.shape[1] != 2:
                raise ValueError(f"a transcoder trains on (input, output) pairs (B, 2, D), found {tuple(batch.shape)}")
            x = (batch[:, 0] - mean) / scale
            y = (batch[:, 1] - target[0]) / target[1]
        x_hat, _ = sae(x)
        loss = (x_hat - y).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sae.normalize_decoder()
        running += float(loss.detach())
        count += 1
        seen += x.shape[0]
        if step % log_every == 0 or step == steps:
            history.append((step, running / count))
            elapsed = time.perf_counter() - t0
            say(
                f"  step {step:4d}  {'reconstruction' if target is None else 'prediction'} loss (fraction of "
                f"variance unexplained) {running / count:.4f}"
                f"  [{seen / elapsed:,.0f} tokens/s]"
            )
            running, count = 0.0, 0
    return history

"""Small torch models for the recorder and dump tests (built here, nothing downloaded).

The dump tests' subprocesses import this module as their model
factory (``tests.support.models:tiny_text_model``), so it stays light.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch


class TinyBlock(torch.nn.Module):
    """Pre-norm residual block; mixes tokens by a masked mean so padding matters."""

    def __init__(self, d: int, tuple_output: bool) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))
        self.mix = torch.nn.Linear(d, d)
        self.tuple_output = tuple_output

    def forward(self, x: Any, mask: Any) -> Any:
        m = mask[:, :, None].to(x.dtype)
        pooled = (x * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
        x = x + self.mlp(self.norm(x)) + self.mix(pooled)
        return (x, pooled) if self.tuple_output else x


class TinyTextModel(torch.nn.Module):
    """A small text encoder: embeddings, a list of blocks, a final norm."""

    def __init__(self, vocab: int = 128, d_model: int = 16, n_blocks: int = 4, max_len: int = 64, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Embedding(max_len, d_model)
        self.blocks = torch.nn.ModuleList(TinyBlock(d_model, tuple_output=i % 2 == 0) for i in range(n_blocks))
        self.final = torch.nn.LayerNorm(d_model)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        self.delay = float(os.environ.get("SAEV_TEST_DELAY", "0"))

    def forward(self, input_ids: Any, attention_mask: Any = None, return_all: bool = False) -> Any:
        if self.delay:
            time.sleep(self.delay)  # lets a test kill a dump mid-way
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))[None]
        outs = []
        for block in self.blocks:
            y = block(x, attention_mask)
            x = y[0] if isinstance(y, tuple) else y
            outs.append(x)
        return outs if return_all else self.final(x)


class TinyViT(torch.nn.Module):
    """A ViT-style model: patch embedding, [CLS] token, `blocks`, like timm's layout."""

    def __init__(self, d_model: int = 12, n_blocks: int = 3, patch: int = 4, image: int = 8) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.patch_embed = torch.nn.Conv2d(3, d_model, patch, patch)
        self.cls = torch.nn.Parameter(torch.randn(1, 1, d_model))
        self.pos = torch.nn.Parameter(torch.randn(1, 1 + (image // patch) ** 2, d_model))
        self.blocks = torch.nn.Sequential(
            *[torch.nn.TransformerEncoderLayer(d_model, 2, 24, dropout=0.0, batch_first=True) for _ in range(n_blocks)]
        )
        self.norm = torch.nn.LayerNorm(d_model)

    def forward(self, pixels: Any, return_all: bool = False) -> Any:
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        return outs if return_all else self.norm(x)


def tiny_tokenize(texts: list[str]) -> list[list[int]]:
    """[CLS]=1, then one id per character (3..127); untruncated."""
    return [[1] + [3 + (ord(c) % 125) for c in t] for t in texts]


def tiny_text_model(**kwargs: Any) -> tuple[TinyTextModel, Any]:
    """The dump tests' model factory (``tests.support.models:tiny_text_model``)."""
    return TinyTextModel(**kwargs).eval(), tiny_tokenize


def broken_factory(what: str) -> tuple[Any, Any]:
    """A factory with a user's mistake: ``what="model"`` returns no module, ``"tokenizer"``
    a tokenizer that returns an int instead of lists of ids."""
    if what == "model":
        return "not a model", tiny_tokenize
    return TinyTextModel().eval(), lambda texts: 42

"""demo.sae: the demo's top-k sparse autoencoder keeps k latents a token, keeps unit-norm
decoder rows, and learns: its loss falls on data it can represent."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from saev_shards.demo.sae import TopKSAE, normaliser, train


def test_codes_keep_at_most_k_latents_and_the_decoder_rows_unit_norm() -> None:
    sae = TopKSAE(8, 32, 3, seed=1)
    x = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    x_hat, z = sae(x)
    assert x_hat.shape == (50, 8) and z.shape == (50, 32)
    assert ((z != 0).sum(dim=1) <= 3).all() and (z >= 0).all()
    torch.testing.assert_close(sae.w_dec.norm(dim=1), torch.ones(32))
    with torch.no_grad():
        sae.w_dec.mul_(3)
    sae.normalize_decoder()
    torch.testing.assert_close(sae.w_dec.norm(dim=1), torch.ones(32))
    with pytest.raises(ValueError, match=r"k must lie in \[1, n_latents=4\], found 5"):
        TopKSAE(8, 4, 5)


def test_training_lowers_the_loss_and_reports_as_asked() -> None:
    gen = torch.Generator().manual_seed(0)
    atoms = torch.randn(4, 8, generator=gen)
    batches = (
        (torch.rand(64, 4, generator=gen) * (torch.rand(64, 4, generator=gen) < 0.3)) @ atoms for _ in range(400)
    )
    lines: list[str] = []
    history = train(
        TopKSAE(8, 16, 2), batches, steps=300, mean=torch.zeros(8), scale=1.0, lr=1e-2, log_every=100, say=lines.append
    )
    assert [step for step, _ in history] == [100, 200, 300]
    assert history[-1][1] < history[0][1]
    assert len(lines) == 3 and "reconstruction loss" in lines[0]
    with pytest.raises(TypeError, match="unexpected keyword arguments: every"):
        train(TopKSAE(8, 16, 2), [], steps=1, mean=torch.zeros(8), scale=1.0, every=3)  # type: ignore[call-arg]


def test_a_transcoder_trains_on_pairs_only() -> None:
    pairs = iter([torch.randn(16, 2, 8)] * 3)
    history = train(
        TopKSAE(8, 16, 2),
        pairs,
        steps=3,
        mean=torch.zeros(8),
        scale=1.0,
        target=(torch.zeros(8), 1.0),
        say=lambda _: None,
    )
    assert [step for step, _ in history] == [3]
    with pytest.raises(ValueError, match=r"\(input, output\) pairs \(B, 2, D\), found \(16, 8\)"):
        train(
            TopKSAE(8, 16, 2),
            [torch.randn(16, 8)],
            steps=1,
            mean=torch.zeros(8),
            scale=1.0,
            target=(torch.zeros(8), 1.0),
        )


def test_the_normaliser_is_the_layers_mean_and_root_mean_variance() -> None:
    stats = {"mean": [[0.0, 0.0], [1.0, 2.0]], "var": [[1.0, 1.0], [4.0, 16.0]]}
    mean, scale = normaliser(stats, 1)
    torch.testing.assert_close(mean, torch.tensor([1.0, 2.0]))
    assert scale == pytest.approx(np.sqrt(10.0))

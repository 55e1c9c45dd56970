"""The recorder: hooked block outputs equal a direct forward pass, in the order of `layers`."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import saev_shards as ss
from saev_shards.dump.recorder import AsyncWriter, Recorder, find_blocks, resolve_modules
from saev_shards.errors import RecorderError

from ...support.caches import small_metadata, tree_bytes
from ...support.models import TinyTextModel, TinyViT


def _ids(batch: int = 3, T: int = 10, seed: int = 0) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, T), generator=gen)
    lengths = torch.tensor([T, T // 2, 1][:batch] + [T] * max(0, batch - 3))
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return ids, mask


def _hooks(model: Any) -> list[tuple[str, list[int]]]:
    return [(name, list(m._forward_hooks)) for name, m in model.named_modules()]


# --------------------------------------------------------------------------------------
# values


@pytest.mark.parametrize("layers", [(0,), (3, 1), (2, 0, 3), (1, 3, 0, 2), (3, 2, 1, 0)])
def test_recorded_values_equal_direct_forward_in_layer_order(layers: tuple[int, ...]) -> None:
    model = TinyTextModel().eval()
    before = _hooks(model)
    ids, mask = _ids()
    with torch.inference_mode():
        direct = model(ids, mask, return_all=True)
    rec = Recorder(model, list(layers), dtype="float32")
    acts = rec.record(ids, attention_mask=mask)
    assert acts.shape == (3, len(layers), 10, 16)
    for slot, layer in enumerate(layers):
        torch.testing.assert_close(acts[:, slot], direct[layer], rtol=0, atol=0)
    assert _hooks(model) == before


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_cast_on_device_equals_torch_cast(dtype: str) -> None:
    model = TinyTextModel().eval()
    ids, mask = _ids()
    with torch.inference_mode():
        direct = model(ids, mask, return_all=True)
    acts = Recorder(model, [2, 0], dtype=dtype).record(ids, attention_mask=mask)
    want = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    assert acts.dtype == want
    assert torch.equal(acts[:, 0], direct[2].to(want))
    assert torch.equal(acts[:, 1], direct[0].to(want))


def test_lengths_zero_padding_positions_only() -> None:
    model = TinyTextModel().eval()
    ids, mask = _ids()
    lengths = mask.sum(1)
    plain = Recorder(model, [1, 3]).record(ids, attention_mask=mask)
    acts = Recorder(model, [1, 3]).record(ids, attention_mask=mask, lengths=lengths)
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(acts[b, :, :n], plain[b, :, :n])
        assert not acts[b, :, n:].any()
        assert n == 10 or plain[b, :, n:].any()  # the model does write something there


def test_dotted_names_and_vit_style_model() -> None:
    model = TinyViT().eval()
    pixels = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        direct = model(pixels, return_all=True)
    assert find_blocks(model) == "blocks"
    acts = Recorder(model, {7: "blocks.2", 5: "blocks.0"}, dtype="float32").record(pixels)
    assert acts.shape == (2, 2, 5, 12)  # CLS + 4 patches
    assert torch.equal(acts[:, 0], direct[2])
    assert torch.equal(acts[:, 1], direct[0])
    by_index = Recorder(model, [-1], dtype="float32").record(pixels)
    assert torch.equal(by_index[:, 0], direct[2])


def test_stop_early_skips_later_blocks() -> None:
    model = TinyTextModel().eval()
    ran = []
    model.blocks[3].register_forward_pre_hook(lambda m, a: ran.append(3))
    ids, mask = _ids()
    Recorder(model, [2, 0]).record(ids, attention_mask=mask)
    assert ran == []
    Recorder(model, [2, 0], stop_early=False).record(ids, attention_mask=mask)
    assert ran == [3]


def test_hooks_removed_on_error() -> None:
    model = TinyTextModel().eval()
    before = _hooks(model)
    ids, _ = _ids()
    with pytest.raises(IndexError):
        Recorder(model, [0, 3]).record(ids + 1000)  # out of the embedding's range
    assert _hooks(model) == before
    model.blocks[1].register_forward_hook(lambda m, a, o: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        Recorder(model, [0, 3]).record(ids)  # another hook fails mid-pass
    assert [h for _, h in _hooks(model)].count([]) == len(before) - 1

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

        def forward(self, x: Any) -> Any:
            return self.blocks[0](self.blocks[0](x))

    twice = Twice()
    before = _hooks(twice)
    with pytest.raises(RecorderError, match="ran twice"):
        Recorder(twice, [0], stop_early=False).record(torch.zeros(1, 2, 4))
    assert _hooks(twice) == before
    with pytest.raises(RecorderError, match=r"layers \[1\] did not run"):
        Recorder(twice, [1]).record(torch.zeros(1, 2, 4))
    assert _hooks(twice) == before


def test_bad_layers_and_names() -> None:
    model = TinyTextModel().eval()
    with pytest.raises(RecorderError, match="out of range: blocks has 4 blocks"):
        Recorder(model, [4])
    with pytest.raises(RecorderError, match="no module named 'nope'"):
        Recorder(model, {0: "nope"})
    with pytest.raises(RecorderError, match="dtype"):
        Recorder(model, [0], dtype="int8")
    with pytest.raises(RecorderError, match="no list of blocks"):
        find_blocks(torch.nn.Linear(2, 2))
    assert {k: n for k, (n, _) in resolve_modules(model, [3, 0]).items()} == {3: "blocks.3", 0: "blocks.0"}


# --------------------------------------------------------------------------------------
# Hugging Face encoders and decoders, built from small configs (nothing downloaded)


def test_hf_bert_encoder_matches_hidden_states() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32
    )
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    assert find_blocks(model) == "encoder.layer"
    ids, mask = _ids(T=8)
    ids = ids % 100
    with torch.inference_mode():
        hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    before = _hooks(model)  # transformers installs its own hooks on the first call
    for layers in itertools.permutations([0, 1, 2], 2):
        acts = Recorder(model, list(layers), dtype="float32").record(input_ids=ids, attention_mask=mask)
        for slot, layer in enumerate(layers):
            assert torch.equal(acts[:, slot], hidden[layer + 1])  # hidden_states[0] is the embeddings
    assert _hooks(model) == before


def test_hf_gpt2_decoder_matches_hidden_states() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=16, n_layer=3, n_head=2, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2Model(cfg).eval()
    assert find_blocks(model) == "h"
    ids, mask = _ids(T=8)
    ids = ids % 100
    with torch.inference_mode():
        hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    acts = Recorder(model, [1, 0], dtype="float32").record(input_ids=ids, attention_mask=mask)
    # GPT-2's last hidden state has the final norm applied; blocks 0 and 1 are plain.
    assert torch.equal(acts[:, 0], hidden[2])
    assert torch.equal(acts[:, 1], hidden[1])


def test_hf_vit_matches_hidden_states() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(
        image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
    )
    torch.manual_seed(0)
    model = transformers.ViTModel(cfg, add_pooling_layer=False).eval()
    pixels = torch.randn(2, 3, 8, 8)
    with torch.inference_mode():
        hidden = model(pixel_values=pixels, output_hidden_states=True).hidden_states
    acts = Recorder(model, [1, 0], dtype="float32").record(pixel_values=pixels)
    assert acts.shape == (2, 2, 5, 16)
    assert torch.equal(acts[:, 0], hidden[2])
    assert torch.equal(acts[:, 1], hidden[1])


# --------------------------------------------------------------------------------------
# AsyncWriter


def test_async_writer_equals_direct_writes(tmp_path: Path) -> None:
    md = small_metadata(d_model=16, patches_per_ex=9, cls_token=True, n_examples=11, patches_per_shard=60)
    model = TinyTextModel().eval()
    ids = torch.randint(3, 128, (md.n_examples, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    lengths = np.arange(md.n_examples, dtype=np.int32) % 10 + 1
    rec = Recorder(model, list(md.layers)[:0] or [1, 3], dtype=md.dtype)
    md = md.replace(layers=(1, 3))
    # Record once and feed the same tensors to both writers: torch's results for different
    # batch shapes may differ in the last bits on some CPUs (AVX-512), and this test is about
    # the writers, whose output depends only on the values written, never on the batching.
    acts = rec.record(ids, attention_mask=mask, lengths=lengths)
    direct = tmp_path / "direct"
    with ss.ShardWriter(direct, md, stats=True, durable=False) as w:
        w.write(acts, columns={"lengths": lengths})
    overlapped = tmp_path / "async"
    with AsyncWriter(ss.ShardWriter(overlapped, md, stats=True, durable=False)) as aw:
        for a in range(0, md.n_examples, 4):
            b = min(a + 4, md.n_examples)
            aw.submit(acts[a:b].clone(), columns={"lengths": lengths[a:b]})
    assert tree_bytes(direct / md.hash) == tree_bytes(overlapped / md.hash)


def test_async_writer_reports_writer_errors(tmp_path: Path) -> None:
    md = small_metadata()
    aw = AsyncWriter(ss.ShardWriter(tmp_path, md, durable=False))
    aw.submit(torch.zeros(2, 2, 3, 8))  # wrong token count: the writer raises in the thread
    with pytest.raises(ss.WriterError, match="expected shape"):
        for _ in range(20):  # the error surfaces on a later submit or on join
            aw.submit(torch.zeros(1, *md.shape[1:]))
        aw.join()
    aw.abort()
    assert not (tmp_path / md.hash).exists()


def test_async_writer_returns_while_the_writer_is_still_busy(tmp_path: Path) -> None:
    """The caller's next forward pass runs while the previous batch is still being written."""
    import threading

    md = small_metadata()
    writer = ss.ShardWriter(tmp_path, md, durable=False)
    release = threading.Event()
    entered = threading.Event()
    real_write = writer.write

    def slow_write(acts: Any, **kw: Any) -> None:
        entered.set()
        assert release.wait(30)
        real_write(acts, **kw)

    writer.write = slow_write  # type: ignore[method-assign]
    data = torch.randn(md.shape, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    with AsyncWriter(writer, depth=2) as aw:
        aw.submit(data[:10])
        assert entered.wait(30)  # the thread is inside write() ...
        aw.submit(data[10:20])  # ... and submit still returns: the queue holds the next batch
        assert not release.is_set()
        release.set()
        aw.submit(data[20:])
    assert np.array_equal(ss.open(tmp_path / md.hash)[:], data.numpy())


def test_import_saev_shards_dump_needs_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, saev_shards, saev_shards.dump, saev_shards.dump.corpus; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_layers_given_as_a_string_is_an_error_that_says_so() -> None:
    model = TinyTextModel(n_blocks=12)
    # "11" would otherwise be read as the layers "1" and "1" (one layer, silently).
    with pytest.raises(
        RecorderError, match=r"layers: expected a list of layer values such as \[11\], found the string '11'"
    ):
        Recorder(model, "11")  # type: ignore[arg-type]
    with pytest.raises(RecorderError, match=r"such as \[1, 3\], found the string '1,3'"):
        resolve_modules(model, "1,3")  # type: ignore[arg-type]
    assert Recorder(model, [11]).layers == (11,)


# --------------------------------------------------------------------------------------
# sites: the input or the output of any module (protocol 3.2)


def test_sites_record_module_inputs_and_outputs_as_the_model_computes_them() -> None:
    """A transcoder's pair (an MLP's input and output) and a block's input, beside a block
    output, in the order given; each equals the tensor computed by hand from the model's own
    modules, and the pair adds up to the block's output as the block's code says."""
    model = TinyTextModel().eval()
    ids, mask = _ids()
    sites: dict[int, Any] = {
        0: "blocks.1.mlp:output",
        1: "blocks.1.mlp:input",
        2: ("blocks.1", "input"),
        3: ss.Site("blocks.1", "output"),
        4: "final",  # a plain name: its output, as before
    }
    rec = Recorder(model, sites, dtype="float32")
    assert rec.sites == (
        ss.Site("blocks.1.mlp", "output"),
        ss.Site("blocks.1.mlp", "input"),
        ss.Site("blocks.1", "input"),
        ss.Site("blocks.1", "output"),
        ss.Site("final", "output"),
    )
    acts = rec.record(ids, attention_mask=mask)
    with torch.inference_mode():
        direct = model(ids, mask, return_all=True)
        block: Any = model.blocks[1]
        x = direct[0]
        mlp_in = block.norm(x)
        mlp_out = block.mlp(mlp_in)
        m = mask[:, :, None].float()
        pooled = (x * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
        final = model.final(direct[-1])
        mixed = block.mix(pooled)
    for slot, want in enumerate([mlp_out, mlp_in, x, direct[1], final]):
        torch.testing.assert_close(acts[:, slot], want, rtol=0, atol=0)
    torch.testing.assert_close(acts[:, 2] + acts[:, 0] + mixed, acts[:, 3], rtol=1e-6, atol=1e-6)
    assert _hooks(model) == [(n, []) for n, _ in _hooks(model)]
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_an_input_site_stops_the_forward_pass_before_its_module_runs() -> None:
    model = TinyTextModel().eval()
    ran = []
    model.blocks[3].register_forward_hook(lambda *a: ran.append(3))
    Recorder(model, {0: "blocks.3:input"}).record(*_ids())
    assert ran == []  # the last block never ran: its input is all that was needed


class _KeywordCaller(torch.nn.Module):
    """Calls its inner module with keywords only, as many Hugging Face layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x: Any) -> Any:
        return self.inner(input=self.norm(x))  # no positional argument: the hooks' keyword path


def test_an_input_given_by_keyword_is_found() -> None:
    model = _KeywordCaller().eval()
    x = torch.randn(2, 3, 4)
    acts = Recorder(model, {0: "inner:input", 1: "inner:output"}, dtype="float32").record(x)
    with torch.inference_mode():
        torch.testing.assert_close(acts[:, 0], model.norm(x))
        torch.testing.assert_close(acts[:, 1], model.inner(model.norm(x)))


@pytest.mark.parametrize(
    ("sites", "message"),
    [
        ({0: "blocks.1.mlp.0:output", 1: "blocks.1.mlp:input"}, r"blocks\.1\.mlp(\.0)?.*shape .* differs"),
        ({0: "blocks.1.mpl:input"}, r"no module named 'blocks\.1\.mpl'"),
        ({0: "blocks.1.mlp:inside"}, r"no module named 'blocks\.1\.mlp:inside'"),
        ({0: ("blocks.1", "sideways")}, "expected a module name or a site"),
    ],
)
def test_bad_sites_are_recorder_errors(sites: dict[int, Any], message: str) -> None:
    with pytest.raises(RecorderError, match=message):
        Recorder(TinyTextModel().eval(), sites).record(*_ids())

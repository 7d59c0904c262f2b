"""The generic loader: sharded checkpoints, dtype conversion, tied embeddings and its typed failures."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import llama_config, random_model, write_checkpoint

from fuseserve.errors import ModelLoadError
from fuseserve.worker.loader import load_model

_config = llama_config


def _qkv(model, layer: int = 0) -> torch.Tensor:
    return model.model.layers[layer].self_attn.qkv_proj.weight


@pytest.fixture(scope="module")
def hf():
    return random_model(_config())


def test_sharded_bf16_checkpoint_loads_as_fp32(hf, tmp_path):
    hf.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20KB")
    hf.float()
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = load_model(tmp_path, _config(), torch.device("cpu"), torch.float32, progress=False)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    attn = hf.model.layers[0].self_attn
    want = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).bfloat16().float()
    torch.testing.assert_close(_qkv(model), want, atol=0, rtol=0)


def test_tied_embeddings_share_one_tensor(tmp_path):
    config = _config(tie_word_embeddings=True)
    write_checkpoint(config, tmp_path)
    model = load_model(tmp_path, config, torch.device("cpu"), torch.float32, progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _edit_checkpoint(hf, path, edit) -> None:
    hf.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_reported(hf, tmp_path):
    _edit_checkpoint(hf, tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match="lacks 1 weights.*layers.1.self_attn.qkv_proj.weight"):
        load_model(tmp_path, _config(), torch.device("cpu"), torch.float32, progress=False)


def test_wrong_shape_is_reported(hf, tmp_path):
    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:10].clone()

    _edit_checkpoint(hf, tmp_path, shrink)
    with pytest.raises(ModelLoadError, match=r"up_proj.weight has shape \(10, 32\), expected \(64, 32\)"):
        load_model(tmp_path, _config(), torch.device("cpu"), torch.float32, progress=False)


def test_truncated_file_is_reported(hf, tmp_path):
    hf.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(tmp_path, _config(), torch.device("cpu"), torch.float32, progress=False)


def test_corrupt_header_is_reported(tmp_path):
    (tmp_path / "model.safetensors").write_bytes((12).to_bytes(8, "little") + b"not json!!!!")
    with pytest.raises(ModelLoadError, match="corrupt safetensors"):
        load_model(tmp_path, _config(), torch.device("cpu"), torch.float32, progress=False)

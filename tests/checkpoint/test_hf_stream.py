"""import-hf / export-hf stream one tensor at a time: a sharded directory imports to transformers' loss, exports
in shards that transformers loads, bit for bit, in the file's dtype or the one asked."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from modelpar.checkpoint.store import read_index
from modelpar.cli.ckpt import main as ckpt_main
from modelpar.cli.generate import load_single_device_model
from modelpar.model.hf_files import INDEX_FILE, HFWeights
from modelpar.model.safetensors_io import TensorReader

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(3))


def _loss(logits: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 96).double(), IDS[:, 1:].reshape(-1)).item()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A random bf16 LlamaForCausalLM in >= 3 shards with a tokenizer, and transformers' fp32 loss on IDS."""
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=500.0,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    path = tmp_path_factory.mktemp("hf") / "llama-bf16"
    model.save_pretrained(path, max_shard_size="20KB")
    tokenizer = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}')
    with torch.no_grad():
        loss = _loss(model.float()(IDS).logits)
    return path, loss


def test_import_keeps_the_files_dtype_and_gives_transformers_loss(sharded, tmp_path, capsys):
    path, want = sharded
    assert len(list(path.glob("model-*-of-*.safetensors"))) >= 3
    assert ckpt_main(["import-hf", str(path), str(tmp_path / "ckpt")]) == 0
    assert "BF16, streamed one tensor at a time" in capsys.readouterr().out
    ckpt = tmp_path / "ckpt" / "step-00000000"
    index = read_index(ckpt, verify=True)
    assert index["model"]["name"] == "llama-bf16" and index["tokenizer"] == str((path / "tokenizer.json").resolve())
    for file in index["files"]:
        with TensorReader(ckpt / file) as reader:
            assert {reader.dtype(k) for k in reader.keys()} == {torch.bfloat16}
    model = load_single_device_model(tmp_path / "ckpt")  # fp32 parameters built from the bf16 checkpoint
    assert next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        assert abs(_loss(model(IDS)[..., :96]) - want) <= 1e-5 * want


def test_import_as_fp32_casts_every_tensor_exactly(sharded, tmp_path):
    path, _ = sharded
    assert ckpt_main(["import-hf", str(path), str(tmp_path / "ckpt"), "--dtype", "fp32"]) == 0
    ckpt = tmp_path / "ckpt" / "step-00000000"
    index = read_index(ckpt)
    piece = index["tensors"]["layers.1.mlp.down_proj.weight"]["pieces"][0]
    with TensorReader(ckpt / piece["file"]) as reader, HFWeights(path) as hf:
        got = reader.read(piece["key"])
        assert got.dtype == torch.float32
        assert torch.equal(got, hf.get_tensor("model.layers.1.mlp.down_proj.weight").float())


def test_export_in_shards_is_bit_exact_loads_in_transformers_and_carries_the_tokenizer(sharded, tmp_path, capsys):
    path, want = sharded
    assert ckpt_main(["import-hf", str(path), str(tmp_path / "ckpt")]) == 0
    out = tmp_path / "out"
    assert ckpt_main(["export-hf", str(tmp_path / "ckpt"), str(out), "--max-shard-size", "10KB"]) == 0
    said = capsys.readouterr().out
    assert "shards + model.safetensors.index.json; tokenizer.json, tokenizer_config.json)" in said, said
    weight_map = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    assert len(set(weight_map.values())) >= 3
    with HFWeights(path) as original, HFWeights(out) as exported:
        assert sorted(original.keys()) == sorted(exported.keys())
        for key in original.keys():
            a, b = original.get_tensor(key), exported.get_tensor(key)
            assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16)), key
    assert transformers.AutoTokenizer.from_pretrained(out)("hello there world")["input_ids"] == [1, 0, 2]
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert next(hf.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        assert abs(_loss(hf.float()(IDS).logits) - want) <= 1e-5 * want


def test_a_config_the_weights_do_not_fit_is_one_line_and_leaves_nothing(sharded, tmp_path, capsys):
    path, _ = sharded
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in path.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 40
    (broken / "config.json").write_text(json.dumps(config))
    assert ckpt_main(["import-hf", str(broken), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "has shape" in err and "the directory's config and weights disagree" in err, err
    assert not list((tmp_path / "ckpt").glob("step-*"))


def test_experts_fused_as_transformers_holds_them_stream_in_one_read_each(tmp_path):
    from safetensors.torch import save_file

    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        rms_norm_eps=1e-5,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state  # [E, 2f, h], gate rows first
    (tmp_path / "hf").mkdir()
    save_file(state, tmp_path / "hf" / "model.safetensors")
    model.config.to_json_file(tmp_path / "hf" / "config.json")
    with torch.no_grad():
        want = _loss(model(IDS).logits)
    assert ckpt_main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    ours = load_single_device_model(tmp_path / "ckpt")
    with torch.no_grad():
        assert abs(_loss(ours(IDS)[..., :96]) - want) <= 1e-5 * want


def test_gpt_oss_mxfp4_experts_are_dequantised_on_import_to_the_dequantised_models_loss(tmp_path, capsys):
    """A random GPT-OSS saved by transformers, its experts replaced by MXFP4 blocks and scales (and
    ``quantization_config`` in config.json), as the released checkpoints hold them: the import dequantises them
    one expert at a time and gives the loss of transformers' model holding the dequantised experts; the banner
    says so; export writes the experts unquantised, which transformers loads to the same loss."""
    from safetensors.torch import load_file, save_file

    from modelpar.model.hf import config_from_hf, import_hf
    from modelpar.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4
    from modelpar.model.transformer import build_model

    config = transformers.GptOssConfig(
        vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    quantised = {}
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(state.pop(key).transpose(1, 2))  # [E, out, in]: blocks along the input
        quantised |= {key + "_blocks": blocks, key + "_scales": scales}
        with torch.no_grad():  # the reference: transformers' model holding the dequantised experts
            model.get_parameter(key).copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2))
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file(state | quantised, hf / "model.safetensors")
    model.config.to_json_file(hf / "config.json")
    written = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(written | {"quantization_config": {"quant_method": "mxfp4"}}))
    with torch.no_grad():
        want = _loss(model(IDS).logits)
    assert ckpt_main(["import-hf", str(hf), str(tmp_path / "ckpt")]) == 0
    assert "MXFP4 experts dequantised" in capsys.readouterr().out
    ours = load_single_device_model(tmp_path / "ckpt")
    direct = build_model(config_from_hf(hf), seed=1)  # the trainer's import (model.init_from), no checkpoint
    import_hf(hf, direct)
    with torch.no_grad():
        assert abs(_loss(ours(IDS)[..., :96].float()) - want) <= 1e-5 * want
        assert abs(_loss(direct(IDS)[..., :96]) - want) <= 1e-5 * want
    assert ckpt_main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert "model.layers.0.mlp.experts.gate_up_proj" in exported and not any(k.endswith("_blocks") for k in exported)
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    reloaded = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert abs(_loss(reloaded(IDS).logits) - want) <= 1e-5 * want

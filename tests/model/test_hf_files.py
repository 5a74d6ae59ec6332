"""Sharded Hugging Face directories: read as transformers writes them, written as transformers reads them, and a
broken directory named in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from modelpar.model.config import ModelConfig
from modelpar.model.hf import config_from_hf, import_hf, save_hf
from modelpar.model.hf_files import INDEX_FILE, HFFilesError, HFWeights, parse_size, plan_shards
from modelpar.model.safetensors_io import TensorReader, TensorWriter
from modelpar.model.transformer import build_model
from modelpar.testing import current_groups, run_on_ranks
from tests.model.reference import HF_IDS, layout_for, rel_err

transformers = pytest.importorskip("transformers")

TOL = 1e-5


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A random LlamaForCausalLM saved by transformers in several shards, and its logits on HF_IDS."""
    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, rms_norm_eps=1e-5, rope_theta=500.0,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(path, max_shard_size="20KB")
    with torch.no_grad():
        logits = model(HF_IDS).logits
    return path, logits


def _shards(path):
    return sorted(p.name for p in path.glob("model-*-of-*.safetensors"))


def test_transformers_wrote_at_least_three_shards(sharded):
    path, _ = sharded
    assert len(_shards(path)) >= 3 and (path / INDEX_FILE).exists() and not (path / "model.safetensors").exists()


def _import_on_ranks(path):
    model = build_model(config_from_hf(path), current_groups(), seed=0)
    import_hf(path, model)
    return model(HF_IDS).detach()


def test_a_sharded_directory_imports_with_transformers_logits_at_tp2(sharded):
    path, want = sharded
    model = build_model(config_from_hf(path), seed=0)
    import_hf(path, model)
    assert rel_err(model(HF_IDS).detach(), want) <= TOL
    logits = torch.cat(run_on_ranks(4, _import_on_ranks, path, layout=layout_for(2))[:2], dim=-1)[..., :61]
    assert rel_err(logits, want) <= TOL


def test_export_in_shards_loads_in_transformers_and_holds_the_same_tensors(sharded, tmp_path):
    path, want = sharded
    model = build_model(config_from_hf(path), seed=0)
    import_hf(path, model)
    save_hf(tmp_path, model.config, model.full_state(), max_shard_size="30KB")
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert len(_shards(tmp_path)) >= 3 and set(index["weight_map"].values()) == set(_shards(tmp_path))
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in model.full_state().values())
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_err(hf(HF_IDS).logits, want) <= TOL
    with HFWeights(path) as original, HFWeights(tmp_path) as exported:
        assert sorted(original.keys()) == sorted(exported.keys())
        assert all(torch.equal(original.get_tensor(k), exported.get_tensor(k)) for k in original.keys())


def test_a_small_model_exports_as_one_file(sharded, tmp_path):
    path, _ = sharded
    model = build_model(config_from_hf(path), seed=0)
    save_hf(tmp_path, model.config, model.full_state())
    assert (tmp_path / "model.safetensors").exists() and not (tmp_path / INDEX_FILE).exists()
    assert load_file(tmp_path / "model.safetensors").keys() == {f"model.{k}" if k != "lm_head.weight" else k
                                                                for k in model.full_state()}  # fmt: skip


def _broken(sharded, tmp_path, damage):
    path, _ = sharded
    copy = tmp_path / "llama"
    shutil.copytree(path, copy)
    damage(copy)
    with pytest.raises(HFFilesError) as info:
        HFWeights(copy)
    message = str(info.value)
    assert "\n" not in message
    return copy, message


def test_a_missing_shard_is_named(sharded, tmp_path):
    def remove(copy):
        (copy / _shards(copy)[1]).unlink()

    copy, message = _broken(sharded, tmp_path, remove)
    assert "is missing" in message and _shards(sharded[0])[1] in message


def test_an_extra_shard_is_named(sharded, tmp_path):
    def add(copy):
        n = len(_shards(copy))
        shutil.copyfile(copy / _shards(copy)[0], copy / f"model-{n + 1:05d}-of-{n + 1:05d}.safetensors")

    _, message = _broken(sharded, tmp_path, add)
    assert "is not named by model.safetensors.index.json" in message


def test_a_tensor_the_index_places_in_the_wrong_file_is_named(sharded, tmp_path):
    def misplace(copy):
        index = json.loads((copy / INDEX_FILE).read_text())
        first, second = _shards(copy)[:2]
        key = next(k for k, f in index["weight_map"].items() if f == first)
        index["weight_map"][key] = second
        (copy / INDEX_FILE).write_text(json.dumps(index))

    _, message = _broken(sharded, tmp_path, misplace)
    assert "places" in message and "which does not hold it (it is in model-00001-of-" in message


def test_a_truncated_shard_is_named(sharded, tmp_path):
    def truncate(copy):
        shard = copy / _shards(copy)[-1]
        shard.write_bytes(shard.read_bytes()[:-10])

    _, message = _broken(sharded, tmp_path, truncate)
    assert _shards(sharded[0])[-1] in message and "truncated" in message


def test_a_directory_without_weights_is_named(tmp_path):
    with pytest.raises(HFFilesError, match="has neither model.safetensors nor model.safetensors.index.json"):
        HFWeights(tmp_path)


def test_shards_follow_transformers_sizes():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(123) == 123
    with pytest.raises(ValueError, match="is not a size"):
        parse_size("lots")
    sizes = {"a": 40, "b": 30, "c": 100, "d": 10}
    assert plan_shards(sizes, 70) == [["a", "b"], ["c"], ["d"]]  # a tensor larger than a shard gets its own


def test_streamed_file_reads_back_exactly_with_rows_of_a_leading_index(tmp_path):
    fused = torch.randn(3, 8, 5).to(torch.bfloat16)
    norm = torch.randn(7)
    writer = TensorWriter(
        tmp_path / "x.safetensors", {"fused": (torch.bfloat16, (3, 8, 5)), "norm": (torch.float32, (7,))}
    )
    writer.write("fused", fused)
    writer.write("norm", norm)
    written = writer.close()
    assert written["bytes"] == (tmp_path / "x.safetensors").stat().st_size
    assert torch.equal(load_file(tmp_path / "x.safetensors")["fused"], fused)
    with TensorReader(tmp_path / "x.safetensors") as reader:
        assert torch.equal(reader.read("fused", (1,), (4, 8)), fused[1, 4:8])
        assert torch.equal(reader.read("norm"), norm)


def test_a_config_shape_the_files_do_not_hold_is_refused_by_import(sharded):
    path, _ = sharded
    wrong = build_model(ModelConfig(vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=48), seed=0)
    with pytest.raises(ValueError, match="got shape"):
        import_hf(path, wrong)

"""The checkpoint on disk: DP replicas write once, consolidation and HF export, clear errors, atomic saves."""

import dataclasses
import glob
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from lightning_megatron.checkpoint import (
    CheckpointMismatchError, IncompleteCheckpointError, consolidate, export_hf_bert, is_checkpoint,
    load_rank_state, load_sharded, read_full_state_dict, read_info, save_sharded,
)
from lightning_megatron.checkpoint.__main__ import main as cli
from lightning_megatron.models import BertModel
from lightning_megatron.models.hf_bert import save_hf_bert
from lightning_megatron.testing import MultiRankError, run_on_ranks
from lightning_megatron.transformer import TransformerConfig
from helpers.checkpoint_utils import activate, assert_same, batches, build_gpt, error_of, global_view, run


def _shard_bytes(path):
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*.distcp")))


# -- data-parallel replicas are written once --------------------------------------------------------------


def _save_with_and_without_replicas(root):
    for name, layout in (("dp2", dict(tp=2)), ("dp1", dict(tp=2, pp=2))):
        state = activate(**layout)
        model = build_gpt(state)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        run(model, state, batches(2), optimizer)
        save_sharded(os.path.join(root, name), model, optimizer)
    return True


def test_data_parallel_replicas_write_once(tmp_path):
    run_on_ranks(_save_with_and_without_replicas, 4, str(tmp_path), timeout=120)
    with_replicas, without = _shard_bytes(tmp_path / "dp2"), _shard_bytes(tmp_path / "dp1")
    # TP2·DP2 holds every shard twice, TP2·PP2 once (its tied output copy is deduplicated too)
    assert abs(with_replicas - without) <= 0.01 * without, (with_replicas, without)
    assert read_info(tmp_path / "dp2")["layout"]["dp"] == 2
    a, b = read_full_state_dict(tmp_path / "dp2"), read_full_state_dict(tmp_path / "dp1")
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)


# -- consolidation --------------------------------------------------------------------------------------


def _consolidate_and_load_back(root):
    ckpt, full = os.path.join(root, "ckpt"), os.path.join(root, "full.pt")
    state = activate(tp=2)
    model = build_gpt(state)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    run(model, state, batches(2), optimizer)
    params = global_view(model, None, state)
    save_sharded(ckpt, model, optimizer, rank_state={"rank": dist.get_rank()})
    assert load_rank_state(ckpt) == {"rank": dist.get_rank()}   # per-rank state (RNG) comes back ...
    if dist.get_rank() == 0:
        consolidate(ckpt, full)
    dist.barrier()
    assert_same(torch.load(full, weights_only=True), params)
    for layout in (dict(tp=1), dict(pp=2)):
        state = activate(**layout)
        fresh = build_gpt(state, init_seed=5)
        load_sharded(full, fresh)                 # a file: the consolidated route
        assert_same(global_view(fresh, None, state), params)
        assert load_rank_state(ckpt) is None      # ... only at the layout it was saved at
    return True


def test_consolidate_round_trip_and_cli(tmp_path):
    run_on_ranks(_consolidate_and_load_back, 2, str(tmp_path), timeout=120)
    assert cli(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "cli.pt")]) == 0
    a, b = torch.load(tmp_path / "full.pt", weights_only=True), torch.load(tmp_path / "cli.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["embedding.word_embeddings.weight"].shape[0] == 100     # the real vocabulary, padding dropped
    assert cli(["consolidate", str(tmp_path / "nothing"), str(tmp_path / "x.pt")]) == 2


def _bert_export(root):
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
                            layernorm_order="post", attn_mask_type="padding", hidden_dropout=0.0,
                            attention_dropout=0.0, layernorm_epsilon=1e-12)
    activate(tp=2)
    model = BertModel(cfg, 100, max_position_embeddings=16)
    save_hf_bert(model, os.path.join(root, "direct"))
    save_sharded(os.path.join(root, "ckpt"), model)
    activate(tp=1)
    fresh = BertModel(dataclasses.replace(cfg, init_seed=9), 100, max_position_embeddings=16)
    export_hf_bert(os.path.join(root, "ckpt"), fresh, os.path.join(root, "exported"))
    return True


def test_bert_checkpoint_exports_to_hugging_face(tmp_path):
    import safetensors.torch as safetensors   # a declared dependency: missing, it must fail, not skip

    run_on_ranks(_bert_export, 2, str(tmp_path), timeout=120)
    direct = safetensors.load_file(str(tmp_path / "direct" / "model.safetensors"))
    exported = safetensors.load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert direct.keys() == exported.keys() and all(torch.equal(direct[k], exported[k]) for k in direct)
    with open(tmp_path / "direct" / "config.json") as a, open(tmp_path / "exported" / "config.json") as b:
        assert json.load(a) == json.load(b)


# -- errors ---------------------------------------------------------------------------------------------


def _wrong_loads(root):
    ckpt, broken = os.path.join(root, "ckpt"), os.path.join(root, "broken")
    state = activate(tp=2)
    model = build_gpt(state, num_layers=2)
    save_sharded(ckpt, model)
    errors = {
        "hidden": error_of(lambda: load_sharded(ckpt, build_gpt(state, num_layers=2, hidden_size=32))),
        "deeper": error_of(lambda: load_sharded(ckpt, build_gpt(state, num_layers=3))),
        "shallower": error_of(lambda: load_sharded(ckpt, build_gpt(state, num_layers=1))),
        "shallower, not strict": error_of(lambda: load_sharded(ckpt, build_gpt(state, num_layers=1), strict=False)),
        "optimizer": error_of(lambda: load_sharded(ckpt, model, torch.optim.Adam(model.parameters()))),
        "nothing there": error_of(lambda: load_sharded(os.path.join(root, "nothing"), model)),
    }
    if dist.get_rank() == 0:
        shutil.copytree(ckpt, broken)
        os.remove(os.path.join(broken, "__1_0.distcp"))
    dist.barrier()
    errors["missing shard"] = error_of(lambda: load_sharded(broken, model))
    return errors


def test_errors_name_the_key_the_shapes_and_the_file(tmp_path):
    per_rank = run_on_ranks(_wrong_loads, 2, str(tmp_path), timeout=120)
    assert per_rank[0] == per_rank[1]             # every rank raises the same error (none hangs)
    e = per_rank[0]
    assert e["hidden"][0] == CheckpointMismatchError.__name__
    assert "'model.embedding.word_embeddings.weight' has global shape (100, 16) in the checkpoint but (100, 32)" \
        in e["hidden"][1]
    assert "'model.decoder.layers.2.attention_norm.weight' (global shape (16,)) is missing" in e["deeper"][1]
    assert "'model.decoder.layers.1." in e["shallower"][1] and "strict=False" in e["shallower"][1]
    assert e["shallower, not strict"] is None
    assert "optimizer 0" in e["optimizer"][1] and "optimizers=None" in e["optimizer"][1]
    assert e["nothing there"][0] == "FileNotFoundError" and "nothing" in e["nothing there"][1]
    assert e["missing shard"][0] == IncompleteCheckpointError.__name__
    assert os.path.join(str(tmp_path), "broken", "__1_0.distcp") in e["missing shard"][1]


# -- atomic saves ---------------------------------------------------------------------------------------


def _interrupted_save(root, how):
    path = os.path.join(root, "last.ckpt")
    state = activate(tp=2)
    model = build_gpt(state, num_layers=2)
    save_sharded(path, model, extra_state={"version": 1})
    before = global_view(model, None, state)
    if dist.get_rank() == 0:
        torch.save(before, os.path.join(root, "before.pt"))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    original = FileSystemWriter.write_data
    if dist.get_rank() == 1:
        def failing_write(self, plan, planner):
            if how == "kill":
                os._exit(3)                       # the rank dies in the middle of the save
            raise OSError("disk full (simulated)")
        FileSystemWriter.write_data = failing_write
    try:
        failure = error_of(lambda: save_sharded(path, model, extra_state={"version": 2}))
    finally:
        FileSystemWriter.write_data = original
    fresh = build_gpt(state, num_layers=2, init_seed=3)
    assert load_sharded(path, fresh) == {"version": 1}
    assert_same(global_view(fresh, None, state), before)
    return failure, error_of(lambda: load_sharded(path + ".incomplete", fresh))


def _previous_checkpoint_is_intact(root):
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, "*.ckpt"))) == ["last.ckpt"]
    assert is_checkpoint(root / "last.ckpt") and not is_checkpoint(root / "last.ckpt.incomplete")
    assert_same(read_full_state_dict(root / "last.ckpt"), torch.load(root / "before.pt", weights_only=True))
    with pytest.raises(IncompleteCheckpointError, match="temporary folder of a save that did not finish"):
        load_sharded(root / "last.ckpt.incomplete", [])
    with pytest.raises(IncompleteCheckpointError, match="did not finish"):
        read_full_state_dict(root / "last.ckpt.incomplete")


def test_a_save_that_raises_on_one_rank_leaves_the_previous_checkpoint(tmp_path):
    out = run_on_ranks(_interrupted_save, 2, str(tmp_path), "raise", timeout=120)
    for failure, incomplete in out:
        assert failure is not None and "disk full" in failure[1]
        assert incomplete[0] == IncompleteCheckpointError.__name__ and "did not finish" in incomplete[1]
    _previous_checkpoint_is_intact(tmp_path)


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(MultiRankError, match="rank 1 exited with code 3"):
        run_on_ranks(_interrupted_save, 2, str(tmp_path), "kill", timeout=60)
    _previous_checkpoint_is_intact(tmp_path)

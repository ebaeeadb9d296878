"""Shard checksums: a byte flipped inside a tensor's payload on disk raises one clear error on every rank."""

import glob
import io
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from lightning_megatron.checkpoint import (
    CorruptCheckpointError, IncompleteCheckpointError, load_sharded, read_full_state_dict, save_sharded,
)
from lightning_megatron.testing import run_on_ranks
from helpers.checkpoint_utils import activate, assert_same, build_gpt, error_of, global_view


def _flip_payload_byte(folder, rank_file):
    """Flip the exponent byte of the first element of the largest float32 model tensor piece stored in ``rank_file``
    (its payload, not the zip framing around it); return that tensor's global name."""
    metadata = FileSystemReader(folder).read_metadata()
    key, info = max(((index.fqn, i) for index, i in metadata.storage_data.items()
                     if i.relative_path == rank_file and index.fqn.startswith("model.")), key=lambda k_i: k_i[1].length)
    path = os.path.join(folder, rank_file)
    with open(path, "rb") as f:
        f.seek(info.offset)
        item = f.read(info.length)
    payload = torch.load(io.BytesIO(item), weights_only=True).contiguous().view(torch.uint8).numpy().tobytes()
    at = info.offset + item.index(payload) + 3   # little-endian float32: byte 3 holds the sign and exponent
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))
    return key


def _damaged_loads(root):
    state = activate(tp=2)
    model = build_gpt(state, num_layers=2)
    optimizer = torch.optim.Adam(model.parameters())
    checked, unchecked = os.path.join(root, "checked"), os.path.join(root, "unchecked")
    save_sharded(checked, model, optimizer, extra_state={"v": 1}, checksums=True)
    save_sharded(unchecked, model, optimizer, extra_state={"v": 1})
    before = global_view(model, None, state)
    fresh = build_gpt(state, num_layers=2, init_seed=3)
    assert load_sharded(checked, fresh, torch.optim.Adam(fresh.parameters())) == {"v": 1}   # intact: loads
    assert_same(global_view(fresh, None, state), before)
    damaged, old, lost = (os.path.join(root, n) for n in ("damaged", "old", "lost"))
    name = [None]
    if dist.get_rank() == 0:
        shutil.copytree(checked, damaged)
        name = [_flip_payload_byte(damaged, "__1_0.distcp")]
        shutil.copytree(damaged, old)   # the same damage in a folder without checksums (as saved before they existed)
        for sums in glob.glob(os.path.join(old, "*.crc32")):
            os.remove(sums)
        shutil.copytree(checked, lost)
        os.remove(os.path.join(lost, "__1_0.distcp.crc32"))
    dist.broadcast_object_list(name)
    errors = {"damaged": error_of(lambda: load_sharded(damaged, fresh)),
              "lost": error_of(lambda: load_sharded(lost, fresh)),
              "old": error_of(lambda: load_sharded(old, fresh))}
    after = global_view(fresh, None, state)
    return errors, name[0], [k for k in before if not torch.equal(after[k], before[k])]


def test_a_flipped_payload_byte_raises_naming_the_file_and_tensor_on_every_rank(tmp_path):
    per_rank = run_on_ranks(_damaged_loads, 2, str(tmp_path), timeout=120)
    assert per_rank[0][0] == per_rank[1][0]          # the same error on every rank (no rank hangs)
    errors, name, silently_wrong = per_rank[0]
    kind, message = errors["damaged"]
    assert kind == CorruptCheckpointError.__name__
    assert os.path.join(str(tmp_path), "damaged", "__1_0.distcp") in message and repr(name) in message
    kind, message = errors["lost"]
    assert kind == IncompleteCheckpointError.__name__ and "__1_0.distcp.crc32 is missing" in message
    # without checksums the same damage loads silently, into that one tensor: what the checksums stop
    assert errors["old"] is None and ["model." + k for k in silently_wrong] == [name]
    with pytest.raises(CorruptCheckpointError, match="__1_0.distcp"):
        read_full_state_dict(tmp_path / "damaged")     # consolidation and inspection check too
    assert read_full_state_dict(tmp_path / "old").keys() == read_full_state_dict(tmp_path / "checked").keys()


def test_checksums_are_an_option_and_their_files_name_every_item(tmp_path):
    run_on_ranks(_damaged_loads, 2, str(tmp_path), timeout=120)
    assert not glob.glob(str(tmp_path / "unchecked" / "*.crc32"))   # off by default (they cost ~30%: see README)
    metadata = FileSystemReader(str(tmp_path / "checked")).read_metadata()
    stored = {(i.relative_path, i.offset, i.length) for i in metadata.storage_data.values()}
    listed = set()
    for sums in glob.glob(str(tmp_path / "checked" / "*.crc32")):
        shard = os.path.basename(sums)[:-len(".crc32")]
        listed |= {(shard, offset, length) for offset, length, _ in json.load(open(sums))["items"]}
    assert listed == stored   # tensor pieces and pickled objects alike

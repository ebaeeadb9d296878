"""DCP planners that write and read *pieces* of global tensors, without DTensor or ShardedTensor.

``torch.distributed.checkpoint`` stores a tensor as chunks (``ChunkStorageMetadata``: offsets
and sizes in the global tensor) and reshards on load by box overlap. Its default planners only
learn chunks from DTensor/ShardedTensor; these planners take them from our ``Entry`` list
instead: one ``SHARD`` write item per piece, under the global key, with the global size. DCP
then does the rest: the coordinator deduplicates identical items across ranks (DP/CP replicas
and tied copies write once, the work spread over the replicas), checks that the chunks tile
every tensor, writes ``.metadata``; on load it computes which stored chunks overlap each piece.
"""

from __future__ import annotations

import io
from typing import Any, Dict, List, Tuple, cast

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType, LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .entries import Entry

_Slot = Tuple[Entry, int]   # (entry, piece index)


class Pickled(bytes):
    """An object already ``torch.save``d (a background save snapshots its objects before training goes on)."""

    @classmethod
    def of(cls, obj: Any) -> "Pickled":
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return cls(buffer.getbuffer())


class PieceSavePlanner(DefaultSavePlanner):
    """Writes every piece of ``entries`` and every object of ``blobs`` (pickled)."""

    def __init__(self, entries: List[Entry], blobs: Dict[str, Any]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries, self.blobs = entries, blobs
        self._slots: Dict[Tuple[str, Tuple[int, ...]], _Slot] = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for entry in self.entries:
            properties = TensorProperties.create_from_tensor(entry.local)
            for i, piece in enumerate(entry.placement.pieces):
                offsets = torch.Size(piece.global_offsets)
                self._slots[(entry.key, tuple(offsets))] = (entry, i)
                items.append(WriteItem(
                    index=MetadataIndex(entry.key, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(piece.sizes)),
                        properties=properties, size=torch.Size(entry.placement.global_shape))))
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.blobs]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        key = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            blob = self.blobs[key]
            return io.BytesIO(blob if isinstance(blob, Pickled) else Pickled.of(blob))
        offset = write_item.index.offset
        assert offset is not None  # a SHARD item: create_local_plan gave it its offsets
        entry, i = self._slots[(key, tuple(offset))]
        return entry.placement.pieces[i].view(entry.local).detach()


class PieceLoadPlanner(DefaultLoadPlanner):
    """Reads every piece of ``entries`` in place and the objects named ``blob_keys`` into ``blobs``."""

    def __init__(self, entries: List[Entry], blob_keys: List[str]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries, self.blob_keys = entries, blob_keys
        self.blobs: Dict[str, Any] = {}
        self._by_key = {entry.key: entry for entry in entries}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        requests: List[ReadItem] = []
        assert self.metadata is not None  # set_up_planner ran first
        for entry in self.entries:
            chunks = [ChunkStorageMetadata(offsets=torch.Size(p.global_offsets), sizes=torch.Size(p.sizes))
                      for p in entry.placement.pieces]
            requests += create_read_items_for_chunk_list(
                entry.key, cast(TensorStorageMetadata, self.metadata.state_dict_metadata[entry.key]), chunks)
        for key in self.blob_keys:
            requests.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                                     dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(key),
                                     storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(requests)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.blobs[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        entry = self._by_key[read_item.dest_index.fqn]
        index = read_item.dest_index.index
        assert index is not None
        piece = entry.placement.pieces[index]   # index: position in our chunk list
        target = piece.view(entry.local)
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, offset, length)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor returned a view of the target: the read already landed in place

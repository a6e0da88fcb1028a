"""Sharded checkpoints of train engines with torch.distributed.checkpoint (DCP), no pickle.

    pool-<name>/.metadata        DCP's index of every tensor: global shape, which file holds
                                 which chunk (read with an allow-list, see `_SafeReader`)
    pool-<name>/__<rank>_0.distcp  each rank's shards: weights and AdamW moments
    pool-<name>/engines.json     optimizer hyper-parameters and scheduler state (rank 0)

Tensors are keyed by parameter name, not by rank or position, so a checkpoint written by 2
ranks loads on 1 or 4 (each rank reads the parts of each tensor its shards cover), under fsdp
or ddp. Only tensors go through DCP: it would pickle anything else, and opening a run directory
must never run code (see docs/reliability.md), so the rest is JSON.
"""

import io
import json
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, metadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

EXTRA = "engines.json"


def save(engines: dict, path: Path, rank: int) -> None:
    """Every rank writes its shards of the trainable `engines` ({model name: TrainEngine})
    into the directory `path`; rank 0 also writes the JSON part. A collective."""
    tensors, extra = {}, {}
    for name, engine in engines.items():
        optimizer = get_optimizer_state_dict(engine.module, engine.optimizer)
        model = get_model_state_dict(engine.module)
        tensors[name] = {"model": model, "optimizer": optimizer["state"]}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer["param_groups"]]
        extra[name] = {"param_groups": groups, "scheduler": engine.scheduler.state_dict()}
    dcp.save(tensors, checkpoint_id=str(path))
    if rank == 0:
        (Path(path) / EXTRA).write_text(json.dumps(extra))


def load(engines: dict, path: Path) -> None:
    """Load what `save` wrote into `engines`, whatever the ranks and strategy that wrote it."""
    tensors, optimizers = {}, {}
    for name, engine in engines.items():
        optimizers[name] = get_optimizer_state_dict(engine.module, engine.optimizer)
        model = get_model_state_dict(engine.module)
        tensors[name] = {"model": model, "optimizer": optimizers[name]["state"]}
    dcp.load(tensors, storage_reader=_SafeReader(path))
    extra = json.loads((Path(path) / EXTRA).read_text())
    for name, engine in engines.items():
        set_model_state_dict(engine.module, tensors[name]["model"])
        state = optimizers[name]
        for group, saved in zip(state["param_groups"], extra[name]["param_groups"], strict=True):
            group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
        set_optimizer_state_dict(engine.module, engine.optimizer, state)
        engine.scheduler.load_state_dict(extra[name]["scheduler"])


def load_weights(module: torch.nn.Module, path: Path, name: str) -> None:
    """Only the weights of model `name`, into a plain (unsharded) module, in this process
    alone (no process group): for `flowrl export`."""
    state = {name: {"model": get_model_state_dict(module)}}
    with warnings.catch_warnings():  # that it reads in one process is the point
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        dcp.load(state, storage_reader=_SafeReader(path), no_dist=True)
    set_model_state_dict(module, state[name]["model"])


# DCP's .metadata is a pickle of these classes only; reading it may build nothing else
ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    *(
        ("torch.distributed.checkpoint.metadata", n)
        for n in (
            "ChunkStorageMetadata",
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
}


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in ALLOWED or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}: refused")


class _SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read through an allow-list, and only tensor
    entries accepted (DCP would unpickle any other entry while loading)."""

    def read_metadata(self, *args, **kwargs) -> metadata.Metadata:
        with open(Path(self.path) / ".metadata", "rb") as f:
            meta = _AllowListUnpickler(io.BytesIO(f.read())).load()
        for key, entry in meta.state_dict_metadata.items():
            if not isinstance(entry, metadata.TensorStorageMetadata):
                raise ValueError(f"{self.path}: entry {key} is not a tensor; refusing to load it")
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = metadata.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta

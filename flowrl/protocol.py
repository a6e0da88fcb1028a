"""DataProto: the batch of one training step.

- `batch`: a TensorDict with one batch dimension (b,) of per-row tensors;
- `non_tensor`: per-row numpy arrays (ground truths, data sources, text), length b;
- `meta`: batch-wide values (step, seed, ...).

Every row operation (index, chunk, split, repeat, concat) keeps tensor and non-tensor
columns aligned. Chunks may be uneven: a user never meets a divisibility error.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterable

import numpy as np
import torch
from tensordict import TensorDict


def _column(values) -> np.ndarray:
    """A 1-D numpy array of per-row values; lists of dicts or lists stay one object per row."""
    if isinstance(values, np.ndarray) and values.ndim >= 1:
        return values
    values = list(values)
    out = np.empty(len(values), dtype=object)
    out[:] = [None] * len(values)
    for i, value in enumerate(values):
        out[i] = value
    return out


class DataProto:
    def __init__(self, batch: TensorDict, non_tensor: dict[str, np.ndarray], meta: dict):
        self.batch, self.non_tensor, self.meta = batch, non_tensor, meta

    @classmethod
    def from_dict(
        cls, tensors: dict | None = None, non_tensor: dict | None = None, meta: dict | None = None
    ) -> DataProto:
        tensors = dict(tensors or {})
        columns = {k: _column(v) for k, v in (non_tensor or {}).items()}
        lengths = {k: len(v) for k, v in [*tensors.items(), *columns.items()]}
        rows = next(iter(lengths.values()), 0)
        for key, length in lengths.items():
            if length != rows:
                raise ValueError(f'column "{key}" has {length} rows, others have {rows}: {lengths}')
        return cls(TensorDict(tensors, batch_size=[rows]), columns, dict(meta or {}))

    @classmethod
    def from_columns(cls, columns: dict, meta: dict | None = None) -> DataProto:
        """From one mapping of key -> column: tensors go to the TensorDict, others to
        non_tensor."""
        tensors = {k: v for k, v in columns.items() if isinstance(v, torch.Tensor)}
        other = {k: v for k, v in columns.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, other, meta)

    def renamed(self, mapping: dict[str, str]) -> DataProto:
        """The same columns with keys renamed by `mapping` (others kept), meta copied."""
        if not self.keys():
            return DataProto(TensorDict({}, batch_size=[len(self)]), {}, dict(self.meta))
        columns = {mapping.get(k, k): self[k] for k in self.keys()}
        return DataProto.from_columns(columns, dict(self.meta))

    def describe(self) -> str:
        """One line for error messages: rows, then each key's shape and dtype."""
        parts = []
        for key in self.keys():
            value = self[key]
            shape = tuple(value.shape) if hasattr(value, "shape") else len(value)
            dtype = str(getattr(value, "dtype", "object")).replace("torch.", "")
            parts.append(f"{key} {shape} {dtype}")
        return f"{len(self)} rows: " + ", ".join(parts)

    # -- columns -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.batch.batch_size[0])

    def __contains__(self, key: str) -> bool:
        return key in self.non_tensor or key in self.batch.keys()

    def keys(self) -> list[str]:
        return sorted([*self.batch.keys(), *self.non_tensor])

    def get(self, key: str, default=None):
        return self[key] if key in self else default

    def __getitem__(self, item):
        if isinstance(item, str):
            if item in self.non_tensor:
                return self.non_tensor[item]
            if item in self.batch.keys():
                return self.batch[item]
            raise KeyError(f'no key "{item}" in the batch; it has {self.keys()}')
        return self.index(item)

    def __setitem__(self, key: str, value) -> None:
        if len(value) != len(self):
            raise ValueError(f'column "{key}" has {len(value)} rows, the batch has {len(self)}')
        if isinstance(value, torch.Tensor):
            self.batch[key] = value
        else:
            self.non_tensor[key] = _column(value)

    def select(self, keys: Iterable[str]) -> DataProto:
        keys = list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"keys {missing} not in the batch; it has {self.keys()}")
        tensors = [k for k in keys if k not in self.non_tensor]
        return DataProto(
            self.batch.select(*tensors),
            {k: self.non_tensor[k] for k in keys if k in self.non_tensor},
            dict(self.meta),
        )

    def pop(self, keys: Iterable[str]) -> DataProto:
        out = self.select(keys)
        for key in out.keys():
            if key in self.non_tensor:
                del self.non_tensor[key]
            else:
                del self.batch[key]
        return out

    def union(self, other: DataProto) -> DataProto:
        """Columns of both; a key in both must hold equal values."""
        if len(other) != len(self):
            raise ValueError(f"union of batches with {len(self)} and {len(other)} rows")
        clashes = [k for k in other.keys() if k in self and not _equal(self[k], other[k])]
        clashes += [
            k for k in other.meta if k in self.meta and not _equal(self.meta[k], other.meta[k])
        ]
        if clashes:
            raise ValueError(f"union: keys {clashes} hold different values in the two batches")
        tensors = {k: self.batch[k] for k in self.batch.keys()}
        tensors |= {k: other.batch[k] for k in other.batch.keys()}
        return DataProto(
            TensorDict(tensors, batch_size=[len(self)]),
            {**self.non_tensor, **other.non_tensor},
            {**self.meta, **other.meta},
        )

    # -- rows ----------------------------------------------------------------------------------
    def index(self, idx) -> DataProto:
        """Rows by int list, slice, numpy / torch int array or bool mask."""
        if isinstance(idx, slice):
            rows = np.arange(len(self))[idx]
        else:
            rows = idx.cpu().numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)
            if rows.dtype == bool:
                rows = rows.nonzero()[0]
        rows = rows.astype(np.int64).reshape(-1)
        batch = self.batch[torch.from_numpy(rows)]
        return DataProto(batch, {k: v[rows] for k, v in self.non_tensor.items()}, dict(self.meta))

    def chunk(self, n: int) -> list[DataProto]:
        """Exactly n parts whose sizes differ by at most one (some empty when n > rows)."""
        return [self.index(part) for part in np.array_split(np.arange(len(self)), n)]

    def split(self, size: int) -> list[DataProto]:
        """Parts of `size` rows; the last may be smaller."""
        if len(self) == 0:
            return [self]
        return [self.index(slice(s, s + size)) for s in range(0, len(self), size)]

    def repeat(self, n: int, interleave: bool = True) -> DataProto:
        """Each row n times: row0 x n, row1 x n, ... (or the whole batch n times)."""
        rows = np.arange(len(self))
        return self.index(np.repeat(rows, n) if interleave else np.tile(rows, n))

    @staticmethod
    def concat(parts: list[DataProto]) -> DataProto:
        keys = parts[0].keys()
        for part in parts[1:]:
            if part.keys() != keys:
                raise ValueError(f"concat: keys differ: {keys} vs {part.keys()}")
        batch = (
            torch.cat([p.batch for p in parts], dim=0)
            if parts[0].batch.keys()
            else TensorDict({}, batch_size=[sum(len(p) for p in parts)])
        )
        columns = {k: np.concatenate([p.non_tensor[k] for p in parts]) for k in parts[0].non_tensor}
        return DataProto(batch, columns, dict(parts[0].meta))

    @staticmethod
    def concat_padded(parts: list[DataProto], left: Iterable[str] = ()) -> DataProto:
        """Concatenate batches whose per-token columns (b, t, ...) may differ in t: each is
        padded with zeros to the widest t among the parts, on the left for the keys in `left`
        (left-padded prompts), on the right for the others (responses; masks are 0 there, so
        no forward or loss sees the padding). Parts without rows are left out."""
        parts = [p for p in parts if len(p)] or parts[:1]
        if len(parts) == 1:
            return parts[0]
        left, padded = set(left), []
        for part in parts:
            columns = {key: part[key] for key in part.keys()}
            for key, value in columns.items():
                if isinstance(value, torch.Tensor) and value.dim() >= 2:
                    extra = max(p[key].shape[1] for p in parts) - value.shape[1]
                    side = (extra, 0) if key in left else (0, extra)
                    pad = (0, 0) * (value.dim() - 2) + side
                    columns[key] = torch.nn.functional.pad(value, pad) if extra else value
            padded.append(DataProto.from_columns(columns, part.meta))
        return DataProto.concat(padded)

    def to(self, device) -> DataProto:
        return DataProto(self.batch.to(device), self.non_tensor, self.meta)

    def clone(self) -> DataProto:
        return DataProto(
            self.batch.clone(), {k: v.copy() for k, v in self.non_tensor.items()}, dict(self.meta)
        )

    # -- storage and transport -------------------------------------------------------------------
    def save(self, path) -> None:
        """Tensors as tensors, the other columns and meta as JSON text: `load` unpickles
        nothing, so opening someone else's saved batch cannot run code."""
        columns = {k: v.tolist() for k, v in self.non_tensor.items()}
        state = {
            "rows": len(self),
            "tensors": {k: self.batch[k].detach().cpu() for k in self.batch.keys()},
            "non_tensor": json.dumps(columns, default=_json_value),
            "meta": json.dumps(self.meta, default=_json_value),
        }
        torch.save(state, path)

    @classmethod
    def load(cls, path) -> DataProto:
        state = torch.load(path, weights_only=True)
        columns = {k: _column(v) for k, v in json.loads(state["non_tensor"]).items()}
        batch = TensorDict(state["tensors"], batch_size=[state["rows"]])
        return cls(batch, columns, json.loads(state["meta"]))

    def __getstate__(self) -> dict:
        """Tensors as numpy arrays, so Ray moves them zero-copy; bfloat16 as an int16 view."""
        tensors = {}
        for key in self.batch.keys():
            value = self.batch[key].detach().cpu()
            if value.dtype == torch.bfloat16:
                tensors[key] = ("bfloat16", value.view(torch.int16).numpy())
            else:
                tensors[key] = (None, value.numpy())
        return {
            "rows": len(self),
            "tensors": tensors,
            "non_tensor": self.non_tensor,
            "meta": self.meta,
        }

    def __setstate__(self, state: dict) -> None:
        tensors = {}
        for key, (kind, array) in state["tensors"].items():
            if not array.flags.writeable:  # Ray's zero-copy buffers are read-only
                array = array.copy()
            value = torch.from_numpy(np.ascontiguousarray(array))
            tensors[key] = value.view(torch.bfloat16) if kind == "bfloat16" else value
        self.batch = TensorDict(tensors, batch_size=[state["rows"]])
        self.non_tensor, self.meta = state["non_tensor"], state["meta"]

    def __repr__(self) -> str:
        cols = [
            f"{k}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
            for k, v in self.batch.items()
        ]
        cols += [f"{k}: ({len(v)},) {v.dtype}" for k, v in self.non_tensor.items()]
        return f"DataProto({len(self)} rows; " + ", ".join(cols) + f"; meta={self.meta})"


def _json_value(value):
    """numpy scalars and arrays inside columns (e.g. in extra_info) as plain JSON values."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} in a batch column cannot be saved as JSON")


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and pickle.dumps(a.tolist()) == pickle.dumps(b.tolist())
    try:
        return bool(a == b)
    except Exception:
        return False

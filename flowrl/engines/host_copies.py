"""Page-locked host memory for a CUDA engine's offloaded tensors.

An offload that calls `tensor.to("cpu")` allocates pageable host memory for every tensor,
every time, and the driver stages each copy through a pinned bounce buffer, one tensor at a
time, waiting for each. Measured on one H200 (bench/colocation.py, graphs/ppo.toml, three
Qwen2-0.5B-shaped models): offload "always" took 10.6 s a step against 2.8 s with "never".

`HostCopies` keeps one page-locked buffer per offloaded tensor, allocated at the first offload
and reused at every later one, and issues the copies without waiting; `wait` (once, after a
whole move) makes them complete before anything reads the host side or frees the device side.
The cost is host memory: the buffers stay allocated while the tensors are back on the device
(the host holds a model's offloaded parts either way; now it keeps their space). Tensors that
are not on a CUDA device (a CPU engine's) move as before, which is to say not at all.
"""

import torch


class HostCopies:
    def __init__(self):
        self.buffers: dict[object, torch.Tensor] = {}
        self.pending = False

    def move(self, key, tensor: torch.Tensor, device) -> torch.Tensor:
        """`tensor` on `device`: to the host into `key`'s page-locked buffer, to the device
        from it; both without waiting (call `wait` after the last)."""
        device = torch.device(device)
        if type(tensor) is not torch.Tensor:  # a DTensor (fsdp's shards) moves its own shard
            return tensor.to(device)
        if device.type == "cpu" and tensor.is_cuda:
            buffer = self.buffers.get(key)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = torch.empty_like(tensor, device="cpu", pin_memory=True)
                self.buffers[key] = buffer
            buffer.copy_(tensor, non_blocking=True)
            self.pending = True
            return buffer
        if device.type == "cuda" and tensor.device.type == "cpu" and tensor.is_pinned():
            self.pending = True
            return tensor.to(device, non_blocking=True)
        return tensor.to(device)

    def wait(self) -> None:
        """Complete the copies issued since the last wait."""
        if self.pending:
            torch.cuda.synchronize()
            self.pending = False

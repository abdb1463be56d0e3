"""Tensor parallelism's process group: one process per rank, the collectives a step runs, and the
step messages rank 0 sends the others.

``TensorParallel.join(rank, world_size, address, device_kind)`` joins the group: NCCL over the GPUs,
gloo over host memory in the simulator. NVLink multicast stays off (NCCL's NVLS, torch's symmetric
memory multicast, NVSHMEM's NVLS: ``MULTICAST_OFF`` in the environment before the communicator
exists): a multicast object can take the GPUs of a shared host out of service. Beside the device
group, gloo groups carry the step messages (pickled host objects) on every device.

The collectives write in place into planned buffers and allocate nothing: ``all_reduce_`` sums a
tensor over the ranks (the row-parallel projections' partial outputs, the vocab-parallel
embedding's rows); ``all_gather_`` fills a buffer whose rank-th chunk each rank wrote (the
vocab-parallel logits). Both run on torch's current stream, so a decode CUDA graph captured around
them records them (NCCL's CUDA-graph support).

Every collective has the group's timeout, so a rank that stops answering ends the others' waits
with an error instead of a hang; a rank whose process exits closes its connections, which ends them
at once (gloo). Workers wait up to IDLE_TIMEOUT_S for rank 0's next step message (a served
model may sit idle between requests); a rank 0 that exits closes its sockets and ends that wait.
"""

from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch

#: Seconds a collective of a step waits for the other ranks before it raises.
COLLECTIVE_TIMEOUT_S = 300.0
#: Seconds a worker waits for rank 0's next message: a served model may be idle that long.
IDLE_TIMEOUT_S = 7 * 24 * 3600.0
#: Environment read at communicator creation: NVLink multicast off in NCCL, torch and NVSHMEM.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class RankError(RuntimeError):
    """A tensor-parallel rank failed; ``rank`` names it."""

    def __init__(self, rank: int, detail: str):
        self.rank = rank
        super().__init__(f"rank {rank} failed: {detail}")


@dataclass
class TensorParallel:
    """This process's place in the tensor-parallel group, and the group's collectives."""

    rank: int
    world_size: int
    device_group: Any  # nccl (GPUs) or gloo (the simulator): the step's collectives
    host_group: Any  # gloo: rank 0's step messages, with the collectives' timeout
    idle_group: Any  # gloo: the length of rank 0's next message, which workers wait for up to IDLE_TIMEOUT_S

    @classmethod
    def join(cls, rank: int, world_size: int, address: str, device_kind: str,
             timeout_s: float = COLLECTIVE_TIMEOUT_S, store: Any = None) -> TensorParallel:
        """Join the group of ``world_size`` ranks that meets at ``address`` (``tcp://host:port``, or
        ``env://`` under torchrun), or in ``store`` (a torch.distributed Store) when given, as ``rank``.
        ``device_kind`` "cuda" runs the collectives on NCCL over this process's current GPU, anything else
        on gloo."""
        import torch.distributed as dist

        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
        backend = "nccl" if device_kind == "cuda" else "gloo"
        if backend == "nccl":
            os.environ.update(MULTICAST_OFF)
        timeout = datetime.timedelta(seconds=timeout_s)
        device_id = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        meeting = {"store": store} if store is not None else {"init_method": address}
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id,
                                **meeting)
        device_group = dist.group.WORLD
        host_group = device_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        idle_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S))
        return cls(rank, world_size, device_group, host_group, idle_group)

    @property
    def is_driver(self) -> bool:
        """Rank 0: it runs the scheduler and announces every step."""
        return self.rank == 0

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """``tensor`` summed over the ranks, in place (a contiguous view of a planned buffer)."""
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.device_group)

    def all_gather_(self, gathered: torch.Tensor, part: torch.Tensor) -> None:
        """Every rank's ``part`` into ``gathered`` (contiguous, world_size x part's elements, rank-major),
        in place: ``part`` is this rank's chunk of ``gathered``."""
        import torch.distributed as dist

        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, part, group=self.device_group)

    def announce(self, message: Any) -> None:
        """Rank 0: send ``message`` (a picklable host object) to every other rank."""
        assert self.is_driver, "only rank 0 announces"
        self._broadcast(message)

    def receive(self) -> Any:
        """A worker: the next message rank 0 announces (waits as long as rank 0 is alive)."""
        assert not self.is_driver, "rank 0 announces; the others receive"
        return self._broadcast(None)

    def gather_to_driver(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` (a picklable host object) on rank 0, in rank order; None on the others.
        Every rank calls it, after the message that asks for it."""
        import torch.distributed as dist

        gathered = [None] * self.world_size if self.is_driver else None
        dist.gather_object(value, gathered, dst=0, group=self.host_group)
        return gathered

    def _broadcast(self, message: Any) -> Any:
        """Rank 0's ``message`` on every rank: its pickled length, then its bytes, over the gloo groups (the
        length on the idle group, since workers wait on it between steps)."""
        import torch.distributed as dist

        payload = pickle.dumps(message) if self.is_driver else b""
        length = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.idle_group)
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.is_driver
                else torch.empty(int(length.item()), dtype=torch.uint8))
        dist.broadcast(data, src=0, group=self.host_group)
        return message if self.is_driver else pickle.loads(data.numpy().tobytes())

    def close(self) -> None:
        """Leave the group (every rank calls it once, at the end)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

"""Rank 0's side of tensor parallelism: it spawns the follower ranks, and wraps its own shard of
the model and of the KV pool so that the engine, unchanged, drives every rank.

:class:`LeaderModel` sends each step's inputs to the followers before running its own forward
(the all-reduces inside keep the ranks in step). :class:`ShardedKVPool` holds rank 0's KV heads
and gathers every rank's heads of a block on export (scattering them on import), so the blocks
that leave the engine, the store's blocks and the handoff always carry the full layout: a TP=2
prefill and a TP=1 decode (or any other pair of sizes) exchange blocks as equals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.engine.kv_layout import KVLayout
from cleave.runtime.engine.kv_pool import KVPool, bytes_per_block
from cleave.runtime.engine.paged_model import AttentionBatch, PagedModel
from cleave.runtime.engine.parallel.follower import (
    batch_to,
    init_group,
    local_blocks,
    receive,
    send,
)
from cleave.runtime.engine.parallel.shard import Shard
from cleave.runtime.models.loader import ModelFiles


class Followers:
    """The follower processes (ranks 1..N-1) and rank 0's pipe to each."""

    def __init__(self, config: EngineConfig, files: ModelFiles, dtype: torch.dtype,
                 device: torch.device) -> None:
        size = config.tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor parallel size {size} needs {size} GPUs; torch sees "
                             f"{torch.cuda.device_count()}")
        # Followers use rank 0's resolved dtype, so every rank computes alike.
        config = dataclasses.replace(config, dtype=str(dtype).removeprefix("torch."))
        self._dir = Path(tempfile.mkdtemp(prefix="cleave-tp-"))
        self.size = size
        self.conns: list[Connection] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        # A fresh interpreter per rank (`python -m ...follower FD`), given the parent's import
        # path: unlike multiprocessing's spawn it never re-runs the caller's __main__ (a
        # script without a main guard, stdin, a notebook), and a socket pair is its pipe.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        for rank in range(1, size):
            ours, theirs = socket.socketpair()
            with theirs:
                process = subprocess.Popen(
                    [sys.executable, "-m", "cleave.runtime.engine.parallel.follower",
                     str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env)
            conn = Connection(ours.detach())
            send(conn, (rank, size, config, files, device))
            self.conns.append(conn)
            self.processes.append(process)

    def send(self, message: Any) -> None:
        for conn in self.conns:
            send(conn, message)

    def receive_all(self) -> list[Any]:
        replies = []
        for rank, conn in enumerate(self.conns, start=1):
            try:
                replies.append(receive(conn))
            except EOFError:
                raise RuntimeError(f"tensor-parallel rank {rank} exited") from None
        return replies

    def connect(self, budget: int, per_block: int, device: torch.device) -> int:
        """Wait for every follower's model; agree on the pool's block count (each rank's
        budget may differ on GPUs); join the process group. Returns the block count."""
        budgets = [budget]
        for rank, (kind, value) in enumerate(self.receive_all(), start=1):
            if kind == "error":
                self.close()
                raise ValueError(f"tensor-parallel rank {rank} failed to load: {value}")
            budgets.append(int(value))
        num_blocks = min(budgets) // per_block
        if num_blocks < 1:
            self.close()
            raise ValueError(f"KV cache budget of {min(budgets)} bytes per rank holds no block "
                             f"({per_block} bytes each)")
        method = f"file://{self._dir / 'store'}"
        self.send(("pool", num_blocks, method))
        init_group(0, self.size, method, device)
        return num_blocks

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # already gone
                send(conn, ("stop",))
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for conn in self.conns:
            conn.close()
        self.conns, self.processes = [], []
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._dir, ignore_errors=True)


class LeaderModel:
    """Rank 0's shard of the model, sending each step to the followers before running it."""

    def __init__(self, model: PagedModel, followers: Followers) -> None:
        self.model = model
        self.followers = followers

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def kv_layout(self) -> KVLayout:
        return self.model.kv_layout

    def weight_bytes(self) -> int:
        """One rank's weights: what bounds each GPU's decode step."""
        return self.model.weight_bytes()

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch,
                k_pool: list[torch.Tensor], v_pool: list[torch.Tensor]) -> torch.Tensor:
        cpu = torch.device("cpu")
        self.followers.send(("forward", input_ids.to(cpu), batch_to(batch, cpu)))
        return self.model.forward(input_ids, batch, k_pool, v_pool)


class ShardedKVPool(KVPool):
    """Rank 0's KV heads; exports and imports blocks in the full layout (every rank's heads)."""

    def __init__(self, layout: KVLayout, shard: Shard, followers: Followers, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(shard.local_layout(layout), num_blocks, block_size, dtype, device)
        self.full_layout = layout
        self.followers = followers

    def export_blocks(self, block_ids: list[int], header_room: int = 0
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self.followers.send(("export", block_ids))
        parts = [local_blocks(self, block_ids), *self.followers.receive_all()]
        buffer, views = self.host_rows(len(block_ids), header_room,
                                       self.full_layout.block_shape(self.block_size))
        heads = self.layout.num_kv_heads
        for rank, part in enumerate(parts):
            for view, block in zip(views, part, strict=True):
                view[:, :, rank * heads:(rank + 1) * heads].copy_(block)
        return buffer, views

    def import_blocks(self, block_ids: list[int], blocks: list[torch.Tensor]) -> None:
        heads = self.layout.num_kv_heads
        for rank, conn in enumerate(self.followers.conns, start=1):
            # clone: a view would pickle the whole buffer it points into
            mine = [b[:, :, rank * heads:(rank + 1) * heads].cpu().clone() for b in blocks]
            send(conn, ("import", block_ids, mine))
        super().import_blocks(block_ids, [b[:, :, :heads] for b in blocks])


def start(config: EngineConfig, files: ModelFiles, dtype: torch.dtype,
          device: torch.device) -> Followers:
    return Followers(config, files, dtype, device)


def join(followers: Followers, model: PagedModel, budget: int, block_size: int,
         dtype: torch.dtype, device: torch.device) -> tuple[LeaderModel, ShardedKVPool]:
    """Rank 0's model and pool, once every follower has loaded and joined the group."""
    shard = Shard(0, followers.size)
    per_block = bytes_per_block(shard.local_layout(model.kv_layout), block_size, dtype)
    num_blocks = followers.connect(budget, per_block, device)
    pool = ShardedKVPool(model.kv_layout, shard, followers, num_blocks, block_size, dtype, device)
    return LeaderModel(model, followers), pool

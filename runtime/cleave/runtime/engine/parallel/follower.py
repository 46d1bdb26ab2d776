"""A follower rank's process (ranks 1..N-1): it loads its shard of the model and its heads of the
KV pool, then runs, step by step, what rank 0 sends it (rank 0 runs the scheduler and HTTP).

Rank 0 starts each follower as ``python -m cleave.runtime.engine.parallel.follower FD``, FD its
end of a socket pair; the first message names its rank and what to load. Then rank 0 sends
``forward`` (a step's token ids and attention batch, on CPU), ``import`` (this rank's heads of
handed-over blocks), ``export`` (answered with this rank's heads of the blocks), ``stop``.
Messages are pickled with the plain pickler, so tensors travel as bytes and never as
shared-memory handles. The forward's all-reduces go over ``torch.distributed`` (gloo on CPU,
NCCL on GPU). A follower exits when its socket closes: rank 0 is gone.
"""

from __future__ import annotations

import pickle
import signal
import sys
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.engine.kv_pool import KVPool, default_budget
from cleave.runtime.engine.paged_model import AttentionBatch, DecodeGroup, PagedModel
from cleave.runtime.engine.parallel.shard import Shard
from cleave.runtime.models.device import resolve_dtype
from cleave.runtime.models.loader import ModelFiles

# A step's collectives finish in well under this; past it a lost rank fails the step instead of
# hanging the worker.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``r`` runs on GPU ``r`` (or the CPU, with every other rank)."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def init_group(rank: int, size: int, init_method: str, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                            rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)


def send(conn: Connection, message: Any) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def batch_to(batch: AttentionBatch, device: torch.device) -> AttentionBatch:
    """A step's batch with its tensors on ``device`` (masks built during a forward are not
    carried: each rank builds its own)."""
    groups = [DecodeGroup(g.first, g.count, g.block_tables.to(device), g.mask.to(device),
                          g.lengths.to(device)) for g in batch.decode_groups]
    prefills = [(first, n, ctx, None if t is None else t.to(device),
                 None if m is None else m.to(device))
                for first, n, ctx, t, m in batch.prefills]
    return AttentionBatch(positions=batch.positions.to(device),
                          slot_mapping=batch.slot_mapping.to(device), decode_groups=groups,
                          prefills=prefills, logits_indices=batch.logits_indices.to(device))


def local_blocks(pool: KVPool, block_ids: list[int]) -> torch.Tensor:
    """``[n, layers, 2, local heads, block_size, dim]`` on the CPU: this rank's part of blocks."""
    ids = torch.tensor(block_ids, dtype=torch.long, device=pool.data.device)
    return pool.data.index_select(3, ids).permute(3, 0, 1, 2, 4, 5).contiguous().cpu()


def follower_main(rank: int, size: int, config: EngineConfig, files: ModelFiles,
                  device: torch.device, conn: Connection) -> None:
    from cleave.runtime.engine.models import build_model
    from cleave.runtime.models.loader import load_config, load_state_dict

    torch.set_num_threads(config.num_threads)
    device = rank_device(device, rank)
    shard = Shard(rank, size)
    try:
        dtype = resolve_dtype(config.dtype, device)
        hf_config, _ = load_config(files)
        model = build_model(hf_config, load_state_dict(files), dtype, device, shard)
        send(conn, ("ready", default_budget(config.kv_cache_bytes, device)))
    except Exception as e:  # rank 0 raises it: the worker fails with the reason, not a hang
        send(conn, ("error", f"{type(e).__name__}: {e}"))
        return
    message = receive(conn)
    if message[0] != "pool":  # rank 0 gave up (another rank failed to load)
        return
    _, num_blocks, init_method = message
    init_group(rank, size, init_method, device)
    try:
        pool = KVPool(shard.local_layout(model.kv_layout), num_blocks, config.block_size,
                      dtype, device)
        serve(model, pool, conn, device)
    finally:
        dist.destroy_process_group()


def serve(model: PagedModel, pool: KVPool, conn: Connection, device: torch.device) -> None:
    while True:
        try:
            message = receive(conn)
        except EOFError:  # rank 0 exited
            return
        kind = message[0]
        if kind == "forward":
            _, input_ids, batch = message
            batch = batch_to(batch, device)
            batch.logits_indices = batch.logits_indices[:0]  # rank 0 samples; skip the head
            model.forward(input_ids.to(device), batch, pool.k, pool.v)
        elif kind == "import":
            pool.import_blocks(message[1], [b.to(device) for b in message[2]])
        elif kind == "export":
            send(conn, local_blocks(pool, message[1]))
        elif kind == "stop":
            return


def main() -> None:
    # A terminal's Ctrl-C reaches the whole process group: rank 0 decides, and this rank exits
    # when rank 0's socket closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(sys.argv[1]))
    rank, size, config, files, device = receive(conn)
    follower_main(rank, size, config, files, device, conn)


if __name__ == "__main__":
    main()

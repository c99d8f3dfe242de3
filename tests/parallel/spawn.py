"""Run a test function on W gloo processes (torch.multiprocessing), and collect what each rank returns.

Workers are module-level functions `fn(rank, world_size, *args) -> object` (picklable results); each
process joins a gloo group through a file rendezvous in a fresh temporary directory and runs on one
CPU thread (W processes share this machine's cores).
"""

from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, out_dir: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # every rank is done with its collectives
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
        raise
    # The result is on disk: leave without interpreter teardown, where gloo's background threads
    # occasionally abort the process ("terminate called without an active exception") after a clean run.
    os._exit(0)


def run_workers(fn, world_size: int, *args) -> list:
    """fn's result on every rank, in rank order; re-raises a worker's traceback as an AssertionError."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        try:
            mp.spawn(_entry, args=(world_size, init_file, tmp, fn, args), nprocs=world_size, join=True)
        except Exception as exc:  # the per-rank files carry the real traceback
            errors = []
            for r in range(world_size):
                path = os.path.join(tmp, f"rank{r}.pt")
                if os.path.exists(path):
                    out = torch.load(path, weights_only=False)
                    if not out["ok"]:
                        errors.append(f"rank {r}:\n{out['error']}")
            raise AssertionError("\n".join(errors) or str(exc)) from None
        results = []
        for r in range(world_size):
            results.append(torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)["result"])
        return results

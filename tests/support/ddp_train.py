"""A DDP training loop over a cache, started by torchrun in tests/integration/test_distributed.py.

Each rank's `ShuffledLoader` takes its rank from the gloo process group. Writes
``<out>/rank<r>.json``: the (example, layer, token) of every batch it trained on, its
``len(loader)``, where its world came from, and a digest of the final weights.

    torchrun --standalone --nproc-per-node 2 tests/support/ddp_train.py CACHE OUT [--stop-after K] [--resume]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from saev_shards.loaders import Batch, ShuffledLoader


def make_loader(cache: str) -> ShuffledLoader:
    return ShuffledLoader(
        cache, batch_size=7, seed=3, drop_last=True, buffer_bytes=300, block_bytes=64, mix_layers=True
    )


def keys(batch: Batch) -> list[tuple[int, int, int]]:
    return list(zip(batch.examples.tolist(), batch.layers.tolist(), batch.tokens.tolist(), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cache")
    parser.add_argument("out")
    parser.add_argument("--stop-after", type=int, default=None, help="save the loader's state after K batches, stop")
    parser.add_argument("--resume", action="store_true", help="load the state saved by --stop-after")
    parser.add_argument("--check-resume", type=int, default=None, help="then, in this process: K batches, new loader")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    loader = make_loader(args.cache)
    state_file = out / f"state{rank}.json"
    if args.resume:
        loader.load_state_dict(json.loads(state_file.read_text()))
    torch.manual_seed(0)
    d_model = loader.shards.metadata.d_model
    model = DistributedDataParallel(torch.nn.Linear(d_model, d_model))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = []
    for step, batch in enumerate(loader, start=1):
        x = batch.acts.float()
        loss = ((model(x) - x) ** 2).mean()
        loss.backward()  # all-reduces the gradients: a rank with fewer batches would hang here
        opt.step()
        opt.zero_grad()
        batches.append(keys(batch))
        if args.stop_after is not None and step == args.stop_after:
            state_file.write_text(json.dumps(loader.state_dict()))
            break
    resumed = []
    if args.check_resume is not None:  # a state taken after K batches, loaded by a new loader
        again = make_loader(args.cache)
        it = iter(again)
        resumed = [keys(next(it)) for _ in range(args.check_resume)]
        state = again.state_dict()
        del it
        later = make_loader(args.cache)
        later.load_state_dict(state)
        resumed += [keys(b) for b in later]
    weights = float(sum(p.detach().double().sum() for p in model.parameters()))
    record = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "source": loader.world.source,
        "len": len(loader),
        "batches": batches,
        "weights": weights,
        "resumed": resumed,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

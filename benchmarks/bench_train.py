"""A training epoch through a mount: ResNet-50 on the GPU fed by a DataLoader reading the
benchmark dataset's files (benchmarks/dataset.py) from each root given, in one run.

The files are not images: each sample's bytes are laid into a 3 x 224 x 224 uint8 tensor (the
bytes repeated), which keeps the GPU's work that of ImageNet training and the loader's that of
reading ~110 KiB files, without a JPEG decoder. bf16 autocast, SGD, channels-last; the first
``--warmup-steps`` steps are not timed. Reports samples/s per root and the share of the epoch the
GPU waited for data.

    python -m benchmarks.bench_train --root local=/data/train --root cachefs=/mnt/train
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torchvision
from torch.utils.data import DataLoader, Dataset

SIDE = 224
SAMPLE = 3 * SIDE * SIDE


class Files(Dataset):
    def __init__(self, root: Path, limit: int | None) -> None:
        paths = sorted(str(p) for p in Path(root).rglob("*.JPEG"))
        self.paths = paths[:limit] if limit else paths
        classes = sorted({Path(p).parent.name for p in self.paths})
        self.label = {name: i for i, name in enumerate(classes)}

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        with open(self.paths[i], "rb") as fh:
            data = fh.read()
        raw = np.frombuffer(data, dtype=np.uint8)
        tiled = np.resize(raw, SAMPLE).reshape(3, SIDE, SIDE)
        return torch.from_numpy(tiled.copy()), self.label[Path(self.paths[i]).parent.name]


def epoch(root: Path, args) -> dict:
    data = Files(root, args.limit)
    loader = DataLoader(data, batch_size=args.batch, shuffle=True, num_workers=args.workers, drop_last=True,
                        pin_memory=True, persistent_workers=False, prefetch_factor=4,
                        generator=torch.Generator().manual_seed(0))
    model = torchvision.models.resnet50(weights=None, num_classes=len(data.label)).cuda()
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mean = torch.tensor([0.485, 0.456, 0.406], device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device="cuda").view(1, 3, 1, 1) * 255
    waited = computed = 0.0
    seen = 0
    started = None
    t = time.perf_counter()
    for step, (x, y) in enumerate(loader):
        got = time.perf_counter()
        x = x.cuda(non_blocking=True).float().sub_(mean).div_(std).contiguous(memory_format=torch.channels_last)
        y = y.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        done = time.perf_counter()
        if step == args.warmup_steps:
            started, waited, computed, seen = got, 0.0, 0.0, 0
        if step >= args.warmup_steps:
            waited += got - t
            computed += done - got
            seen += len(y)
        t = done
    seconds = time.perf_counter() - (started or t)
    return {"samples_s": round(seen / seconds, 1), "data_wait_share": round(waited / max(waited + computed, 1e-9), 3),
            "samples": seen, "seconds": round(seconds, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", action="append", required=True, help="NAME=DIR (repeatable)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--drop", action="store_true", help="drop the page cache before each root")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    rows = {}
    for spec in args.root:
        name, _, root = spec.partition("=")
        if args.drop:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        rows[name] = epoch(Path(root), args)
        print(f"{name:<24} {rows[name]['samples_s']:>8,.0f} samples/s  data wait {rows[name]['data_wait_share']:.0%}",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

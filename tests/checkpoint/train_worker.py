"""A small deterministic training script for the fault tests (run as a subprocess).

It resumes from the flash checkpoint when there is one, trains to ``--steps`` saving every step to
memory (and to storage every ``--persist-every`` steps), prints ``STEP n`` after each save and writes
the final parameters as safetensors. Dropout, numpy and python randomness make the result depend on
every restored RNG state.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import numpy as np
import torch
from safetensors.torch import save_file

from phalanx.checkpoint import Checkpointer, ElasticDistributedSampler

BATCH = 8


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--persist-every", type=int, default=0)
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args()

    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    data = torch.randn(1000, 16, generator=torch.Generator().manual_seed(1))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sampler = ElasticDistributedSampler(len(data), seed=3)
    ckpt = Checkpointer()
    start = 1
    loaded = ckpt.load()
    if loaded is not None:
        step, state = loaded
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        sampler.load_state_dict(state["sampler"])
        start = step + 1
        print("LOADED", step, json.dumps(ckpt.last_load), flush=True)
    order = iter(sampler)
    for step in range(start, args.steps + 1):
        idx = [next(order) for _ in range(BATCH)]
        x = data[idx]
        scale = 1.0 + 0.01 * float(np.random.rand()) + 0.01 * random.random()
        loss = (model(x).squeeze(-1) - x.sum(-1)).pow(2).mean() * scale
        opt.zero_grad()
        loss.backward()
        opt.step()
        state = {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
            "sampler": sampler.state_dict(),
            "step": step,
        }
        ckpt.save(step, state, persist=bool(args.persist_every) and step % args.persist_every == 0)
        print("STEP", step, flush=True)
        time.sleep(args.step_delay)
    ckpt.wait()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.out)
    ckpt.close()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

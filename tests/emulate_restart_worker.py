"""One rank of one attempt of a torchrun job, for test_emulate_warnings_restart: a new process
that joins the store the test holds as torchrun's agent would (a TCPStore client wrapped as
env:// wraps it), with the attempt's TORCHELASTIC_* variables the test sets. Its process group
is torch's own "fake" test backend, so that no peer need connect: gloo over a store kept across
attempts reads the crashed attempt's addresses (pytorch issue 135712) and fails at random."""

from __future__ import annotations

import json
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as torch_dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.recipe import FP8Recipe

#: The kinds these steps meet: 5 tokens stop TE's forward, out_features 24 its backward.
KINDS = {"TransformerEngine stops the forward": "forward", "Caller must pad": "backward"}
WORLD_SIZE = 2


def steps() -> list[str]:
    """Three training steps of a new layer TE would refuse; the kinds the console printed,
    each as '<prefix>|<kind>'."""
    layer = EmulatedFP8Linear(64, 24)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # what the user's console would print
        for length in (5, 8, 5):
            with fp8_autocast(recipe=FP8Recipe()):
                layer(torch.randn(length, 64)).sum().backward()
    return [f"{str(w.message).split(']')[0]}]|{kind}" for w in caught
            for key, kind in KINDS.items() if key in str(w.message)]


def main(port: int, rank: int, out_file: str) -> None:
    """Train `steps` as `rank` of 2 and write the lines it printed to `out_file`."""
    store = torch_dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=False,
                                timeout=timedelta(seconds=60))
    torch_dist.init_process_group("fake", store=torch_dist.PrefixStore("default_pg", store),
                                  rank=rank, world_size=WORLD_SIZE)
    try:
        Path(out_file).write_text(json.dumps(steps()))
    finally:
        torch_dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])

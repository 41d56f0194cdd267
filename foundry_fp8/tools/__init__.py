"""Shipped tools around training, not part of it: `foundry-fp8 tiny-data` (the local tokenizer
and dataset a CPU try needs) and `foundry-fp8 bench` (MPT-1B throughput, its YAMLs in
`tools/yamls/`). The training runtime never imports them; the repository's own `make run` job
is `scripts/demo.py`, outside the package."""

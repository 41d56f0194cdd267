"""Everything that knows TransformerEngine, in one folder; importing it imports nothing.

- `facts`: every TE / CUDA / GPU version fact we rely on, torch-free, read by the backend, the
  linter, the doctor and `fp8_state`.
- `backend`: building TE modules, their FP8 state and recipes, entering TE's autocast (imports
  TE lazily).
- `probe`: which TE is installed, what TE's modules and FP8 global state look like, read without importing TE.
- `extra_state`: TE's pickled `_extra_state` in checkpoints, kept loadable.
- `recompute`: the TE #1190 activation-recompute policy.
- `debug`: TE's debug API (nvdlfw-inspect's `LogFp8TensorStats`) for `fp8_stats: {te_debug}`.
"""

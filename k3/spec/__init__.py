"""Speculative decoding's draft model and its training (docs/speculative.md; K3 report §4.1.4, §5.4.2).

- `draft`: the draft (one decoder block on fused target features), its unrolled training-time test and the LK loss.
- `train`: `k3 train-draft`, the draft's training run (frozen target, resume, metrics, plots).
- `cli`: the command-line front end.
"""

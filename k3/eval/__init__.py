"""Evaluation and ablations (docs/evaluation.md, docs/ablations.md): `k3 eval MODEL` runs lm-evaluation-harness,
HumanEval, long-context retrieval and perplexity against the OpenAI-compatible server (a local model is served
first); `k3 ablate NAME` trains a K3 design choice against the baseline it replaced."""

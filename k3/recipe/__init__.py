"""Recipes: a model's whole lifecycle (pre-train → SFT → effort-level RL → MOPD with QAT → draft → evaluate → serve)
as one command, `k3 recipe run`, each stage the existing `k3` command in a process of its own, and a report card
(docs/recipe.md)."""

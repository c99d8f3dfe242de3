"""Post-training (K3 report §4.1): supervised fine-tuning on K3's chat format (`conversations.py`, `sft.py`, the
generated data set `sft_data.py`) and RL with effort levels and token budgets (`rl.py` and the modules it uses).
Both run on what pre-training built: the `k3 train` loop, the server's chat template and the inference engine."""

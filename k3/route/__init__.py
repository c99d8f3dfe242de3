"""The fleet router (`k3 route`): an OpenAI-compatible front door over several `k3 serve` replicas, with
conversation affinity by consistent hashing, failover to a pre-assigned secondary, and admission per class."""

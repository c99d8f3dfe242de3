"""Per-Head Muon + AdamW in one optimizer, routed by parameter name (docs/optimizer.md; K3 report §2.5, §3.3).

Legend: H heads, K KDA head dim, D model width, N nope dim, R rope dim, Vd value dim, C kv_lora_rank,
Q q_lora_rank, E experts, I expert hidden width, L latent width; a block is [rows, cols].

Every parameter gets exactly one row of `ROUTING_TABLE` (a name pattern; `ndim == 2` is not enough):
- Muon parameters are seen as a stack of blocks [n_blocks, rows, cols] (`muon_block_view`), each block
  orthogonalised on its own: KDA q/k/v per head, MLA q_b_proj per head, kv_b_proj per head *and* per K/V
  half, routed experts per expert, every other matrix whole.
- AdamW takes the embedding, lm_head, norm gains, AttnRes vectors, KDA gate/conv parameters.

Muon step per block (momentum μ, Nesterov in lerp form, same formula as `torch.optim.Muon`):
    M ← lerp(M, G, 1−μ);  N ← lerp(G, M, μ);  O = NS5(N);  W ← W(1 − ηλ) − η·0.2·√max(rows, cols)·O
The 0.2·√max(rows, cols) factor gives every block the update RMS of AdamW (Moonlight; torch's
`adjust_lr_fn="match_rms_adamw"`), so both rules share η and λ. Newton–Schulz runs batched: blocks of equal
(oriented) shape are stacked across all parameters and iterated with `torch.bmm`/`torch.baddbmm`.

State is fp32 whatever the parameter dtype (Muon momentum; AdamW moments); `load_state_dict` keeps it fp32.

`impl` picks how the elementwise passes run (docs/optimizer.md, "Fused step"): "reference" is the foreach
code below; "fused" runs AdamW in torch's fused kernel (`torch._fused_adamw_`, one pass instead of about ten)
and Muon's momentum and update in two multi-tensor Triton kernels (`fused_muon.py`, bitwise equal to the
reference on CUDA); "auto" (default) is "fused" on CUDA. Newton–Schulz is the same code in both.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from itertools import chain
from typing import Literal

import torch
from torch import Tensor
from torch.nn import Parameter

from k3.config import ModelConfig
from k3.optim.fused_muon import muon_momentum, muon_update, triton

# Keller Jordan's quintic Newton–Schulz coefficients and normaliser eps (the values of torch.optim.Muon).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
# Update RMS of an orthogonalised block times √max(rows, cols) ≈ 1; 0.2 matches AdamW's typical update RMS.
RMS_MATCH = 0.2
# Largest stacked Newton–Schulz batch (elements); bigger groups of equal shape run in several batches.
NS_BATCH_ELEMENTS = 1 << 27

_LAYER = r"model\.layers\.\d+\."

# (name pattern, view): view is how a Muon parameter splits into blocks, None for AdamW.
ROUTING_TABLE: list[tuple[str, str | None]] = [
    # Per-head Muon (§2.5): no cross-head coupling in the orthogonalisation
    (_LAYER + r"self_attn\.(q|k|v)_proj\.weight", "kda_heads"),           # H × [K, D]
    (_LAYER + r"self_attn\.q_b_proj\.weight", "mla_q_heads"),              # H × [N + R, Q]
    (_LAYER + r"self_attn\.kv_b_proj\.weight", "mla_kv_heads"),            # 2H × [N, C]: K and V separately
    # Routed experts: one block per expert
    (_LAYER + r"block_sparse_moe\.experts\.w[123]", "experts"),            # E × [I, L] or E × [L, I]
    # Muon on the whole matrix
    (_LAYER + r"self_attn\.(g_proj|o_proj|b_proj|f_a_proj|f_b_proj)\.weight", "whole"),
    (_LAYER + r"self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight", "whole"),
    (_LAYER + r"block_sparse_moe\.(gate|routed_expert_down_proj|routed_expert_up_proj)\.weight", "whole"),
    (_LAYER + r"block_sparse_moe\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight", "whole"),
    (_LAYER + r"mlp\.(gate_proj|up_proj|down_proj)\.weight", "whole"),
    # AdamW
    (_LAYER + r"self_attn\.(q|k|v)_conv1d\.weight", None),
    (_LAYER + r"self_attn\.(dt_bias|A_log)", None),
    (_LAYER + r"self_attn\.(o_norm|q_a_layernorm|kv_a_layernorm)\.weight", None),
    (_LAYER + r"block_sparse_moe\.routed_expert_norm\.weight", None),
    (_LAYER + r"(input_layernorm|post_attention_layernorm)\.weight", None),
    (_LAYER + r"(self_attention|mlp)_res_(norm|proj)\.weight", None),
    (r"model\.(norm|output_attn_res_norm|output_attn_res_proj)\.weight", None),
    (r"model\.embed_tokens\.weight", None),
    (r"lm_head\.weight", None),
]
_COMPILED = [(re.compile(pattern), view) for pattern, view in ROUTING_TABLE]


@dataclass(frozen=True)
class ParamRule:
    kind: Literal["muon", "adamw"]
    block_view: tuple[int, int, int] | None  # (n_blocks, rows, cols) for Muon, None for AdamW
    view: str  # the ROUTING_TABLE view name ("adamw" for AdamW)


def _block_shape(view: str, name: str, shape: torch.Size, config: ModelConfig) -> tuple[int, int, int]:
    H = config.num_attention_heads
    N, R, Vd = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    if view == "experts":
        if len(shape) != 3:
            raise ValueError(f"{name}: routed experts must be stacked [E, rows, cols], got {tuple(shape)}")
        return tuple(shape)
    if len(shape) != 2:
        raise ValueError(f"{name}: expected a matrix, got shape {tuple(shape)}")
    rows, cols = shape
    if view == "whole":
        return 1, rows, cols
    if view == "kda_heads":
        n, r = config.linear_attn_config.num_heads, config.linear_attn_config.head_dim
    elif view == "mla_q_heads":
        n, r = H, N + R
    elif view == "mla_kv_heads":
        if N != Vd:
            raise ValueError(f"{name}: per-head K/V blocks need qk_nope_head_dim == v_head_dim ({N} != {Vd})")
        n, r = 2 * H, N
    else:
        raise AssertionError(view)
    if n * r != rows:
        raise ValueError(f"{name}: {tuple(shape)} does not split into {n} blocks of {r} rows")
    return n, r, cols


def param_rule(name: str, param: Tensor, config: ModelConfig) -> ParamRule:
    """The one routing-table row for parameter `name`; ValueError for unknown or ambiguous names."""
    hits = [view for pattern, view in _COMPILED if pattern.fullmatch(name)]
    if len(hits) != 1:
        what = "matches no row" if not hits else f"matches {len(hits)} rows"
        raise ValueError(f"parameter {name!r} {what} of the optimizer routing table (k3/optim/muon.py)")
    view = hits[0]
    if view is None:
        return ParamRule("adamw", None, "adamw")
    return ParamRule("muon", _block_shape(view, name, param.shape, config), view)


def muon_block_view(name: str, param: Tensor, config: ModelConfig) -> Tensor:
    """The Newton–Schulz blocks of a Muon parameter: a view [n_blocks, rows, cols] of its storage.

    Rows keep the model's layout (docs/architecture.md §3): q_b_proj block h = rows h·(N+R) … (h+1)·(N+R)
    ([nope | rope]); kv_b_proj block 2h = head h's K rows, block 2h+1 = its V rows.
    """
    rule = param_rule(name, param, config)
    if rule.kind != "muon":
        raise ValueError(f"{name} is optimised by AdamW, it has no Muon block view")
    return param.view(rule.block_view)


def newton_schulz(X: Tensor, steps: int = 5) -> Tensor:
    """Quintic Newton–Schulz on a stack X [n, a, b] (a ≤ b) in X's dtype: ≈ U·S'·Vᵀ with S' in ~[0.68, 1.13].

    Each block is normalised by its own Frobenius norm (spectral norm ≤ 1), then five times
    A = XXᵀ, X ← 3.4445·X + (−4.7750·A + 2.0315·A²)·X — torch.optim.Muon's op order, batched.
    """
    assert X.dim() == 3 and X.shape[1] <= X.shape[2], "orient blocks so that rows <= cols"
    a, b, c = NS_COEFFICIENTS
    X = X / (torch.linalg.vector_norm(X, dim=(1, 2), keepdim=True) + NS_EPS)
    for _ in range(steps):
        A = torch.bmm(X, X.mT)  # [n, a, a]
        poly = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, poly, X, beta=a)
    return X


class MuonAdamW(torch.optim.Optimizer):
    """Per-Head Muon for matrices, AdamW for the rest; one optimizer, two param groups ("muon", "adamw").

    - `named_params`: (name, parameter) pairs, e.g. `model.named_parameters()`; names select the rule.
    - Both groups carry `lr` (and `initial_lr` once a scheduler runs), so one LambdaLR scales both.
    - `ns_dtype`: Newton–Schulz dtype; None = bfloat16 on CUDA, float32 on CPU (accurate on every CPU,
      fast or not at bf16). torch.bfloat16 reproduces the GPU numerics and torch.optim.Muon, and is faster
      on CPUs with AVX512-BF16/AMX (docs/optimizer.md, "Cost").
    - Parameters without a gradient are skipped (no decay, no state), as in torch's optimizers.
    - `impl`: "reference" (foreach ops), "fused" (fused AdamW + Triton Muon kernels), "auto" = fused on CUDA.
      Not part of the state dict: a checkpoint of either loads into the other.
    - `muon_blocks`: "per_head" (K3); the ablation baselines (docs/ablations.md) "whole_matrix" (the per-head views
      orthogonalised as one matrix) and "none" (AdamW for every parameter).
    """

    def __init__(self, named_params: Iterable[tuple[str, Parameter]], config: ModelConfig, lr: float,
                 weight_decay: float = 0.1, momentum: float = 0.95, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, ns_steps: int = 5, ns_dtype: torch.dtype | None = None,
                 impl: Literal["auto", "reference", "fused"] = "auto",
                 muon_blocks: Literal["per_head", "whole_matrix", "none"] = "per_head"):
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not 1 <= ns_steps < 100:
            raise ValueError(f"ns_steps must be in [1, 100), got {ns_steps}")
        if impl not in ("auto", "reference", "fused"):
            raise ValueError(f"impl must be 'auto', 'reference' or 'fused', got {impl!r}")
        self.impl = impl
        muon, adamw = [], []
        self.block_shapes: dict[Tensor, tuple[int, int, int]] = {}
        seen: set[Tensor] = set()
        for name, p in named_params:
            if p in seen:
                raise ValueError(f"parameter {name!r} is listed twice (tied weights are not supported)")
            seen.add(p)
            rule = param_rule(name, p, config)
            if rule.kind == "muon" and muon_blocks == "none":
                rule = ParamRule("adamw", None, "adamw")
            elif rule.view in ("kda_heads", "mla_q_heads", "mla_kv_heads") and muon_blocks == "whole_matrix":
                rule = ParamRule("muon", (1, *p.shape), "whole")
            if rule.kind == "muon":
                muon.append((name, p))
                self.block_shapes[p] = rule.block_view
            else:
                adamw.append((name, p))
        if not seen:
            raise ValueError("MuonAdamW got no parameters")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, betas=tuple(betas), eps=eps,
                        ns_steps=ns_steps, ns_dtype=ns_dtype)
        groups = [{"params": [p for _, p in pairs], "param_names": [n for n, _ in pairs], "kind": kind}
                  for kind, pairs in (("muon", muon), ("adamw", adamw))]
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _fused(self, t: Tensor) -> bool:
        """Whether this step runs the fused kernels: impl "fused", or "auto" on CUDA (with triton installed)."""
        return self.impl == "fused" or (self.impl == "auto" and t.is_cuda and triton is not None)

    def _muon_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        ns_dtype = group["ns_dtype"] or (torch.bfloat16 if params[0].device.type == "cuda" else torch.float32)
        fused = self._fused(params[0])
        grads = [local_tensor(p.grad) for p in params]
        bufs = [local_tensor(self._state_tensor(p, "momentum_buffer")) for p in params]
        if fused:
            nesterov = muon_momentum(bufs, grads, mu, ns_dtype)  # already in ns_dtype: the stacking only copies
        else:
            grads = [g.float() for g in grads]
            torch._foreach_lerp_(bufs, grads, 1 - mu)
            nesterov = torch._foreach_lerp(grads, bufs, mu)
        updates = self._orthogonalize(params, nesterov, ns_dtype, group["ns_steps"])
        weights = [local_tensor(p) for p in params]
        alphas = [-(lr * (RMS_MATCH * math.sqrt(max(self.block_shapes[p][1:])))) for p in params]
        if fused:
            muon_update(weights, updates, 1 - lr * wd, alphas)
            return
        for w, o, alpha in zip(weights, updates, alphas):
            w.mul_(1 - lr * wd)
            w.add_(o, alpha=alpha)  # mixed-dtype add: no cast copy

    def _orthogonalize(self, params: list[Parameter], nesterov: list[Tensor], ns_dtype: torch.dtype,
                       steps: int) -> list[Tensor]:
        """NS5 of every block of every parameter; returns one tensor per parameter in its (local) shape.

        The distributed optimizer (k3.parallel.muon) overrides this with the owner exchange.
        """
        stacks = ((i, n.view(self.block_shapes[p])) for i, (p, n) in enumerate(zip(params, nesterov)))
        ortho = orthogonalize_blocks(stacks, ns_dtype, steps)
        return [ortho[i].reshape(n.shape) for i, n in enumerate(nesterov)]

    def _state_tensor(self, p: Parameter, key: str) -> Tensor:
        """Optimizer state `key` of p, created as fp32 zeros shaped like p (a DTensor for a DTensor p)."""
        state = self.state[p]
        if key not in state:
            state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        return state[key]

    def _adamw_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        grads = [local_tensor(p.grad).float() for p in params]
        for p in params:
            if "step" not in self.state[p]:
                self.state[p]["step"] = torch.tensor(0.0)
        m = [local_tensor(self._state_tensor(p, "exp_avg")) for p in params]
        v = [local_tensor(self._state_tensor(p, "exp_avg_sq")) for p in params]
        # math in fp32; a low-precision parameter is updated through an fp32 copy
        local = [local_tensor(p) for p in params]
        work = [w if w.dtype == torch.float32 else w.float() for w in local]
        if self._fused(params[0]):
            # one pass over W, G, M, V instead of the chain below; the kernel reads the step counts where
            # the parameters are (torch.optim.AdamW(fused=True) keeps them there too)
            for p, w in zip(params, work):
                self.state[p]["step"] = self.state[p]["step"].to(w.device)
            steps = [self.state[p]["step"] for p in params]
            torch._foreach_add_(steps, 1.0)
            torch._fused_adamw_(work, grads, m, v, [], steps, lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd,
                                eps=eps, amsgrad=False, maximize=False)
        else:
            steps = [self.state[p]["step"] for p in params]
            torch._foreach_add_(steps, 1.0)
            torch._foreach_mul_(work, 1 - lr * wd)
            torch._foreach_lerp_(m, grads, 1 - beta1)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, grads, grads, 1 - beta2)
            bias1 = [1 - beta1 ** s.item() for s in steps]
            bias2 = [1 - beta2 ** s.item() for s in steps]
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, [math.sqrt(b) for b in bias2])
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(work, m, denom, [-lr / b for b in bias1])
        for w_local, w in zip(local, work):
            if w is not w_local:
                w_local.copy_(w)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a `state_dict()`; the parameter names of both groups must match this optimizer's."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(saved_groups)} param groups, expected "
                             f"{len(self.param_groups)}")
        for group, saved in zip(self.param_groups, saved_groups):
            if saved.get("kind") != group["kind"] or saved.get("param_names") != group["param_names"]:
                raise ValueError(f"optimizer state does not match this model: its {saved.get('kind')!r} group "
                                 f"holds other parameters than this optimizer's {group['kind']!r} group")
        super().load_state_dict(state_dict)
        # The base class casts state to each parameter's dtype and may share storage with `state_dict`;
        # keep the fp32 master state, in storage of our own.
        saved_ids = chain.from_iterable(g["params"] for g in saved_groups)
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(saved_ids, params):
            if pid in state_dict["state"]:
                self.state[p] = {k: v.clone() if k == "step" or hasattr(v, "to_local") else v.to(p.device).clone()
                                 for k, v in state_dict["state"][pid].items()}


def local_tensor(t: Tensor) -> Tensor:
    """The local shard of a DTensor (sharing its storage), or t itself: the optimizer's math is per element
    or per owned block, so it runs on local shards; k3.parallel.muon does the cross-rank part."""
    return t.to_local() if hasattr(t, "to_local") else t


def orthogonalize_blocks(stacks: Iterable[tuple[Hashable, Tensor]], ns_dtype: torch.dtype,
                         steps: int) -> dict[Hashable, Tensor]:
    """NS5 of every block of each (key, blocks [n, rows, cols]) stack; returns key -> [n, rows, cols] in ns_dtype.

    Blocks are oriented rows <= cols, bucketed by shape across stacks and run in batches of at most
    NS_BATCH_ELEMENTS elements. MuonAdamW and the unit owners of P2P Muon (k3.parallel.muon) both use it.
    """
    buckets: dict[tuple[int, int], list[tuple[Hashable, Tensor, bool]]] = defaultdict(list)
    for key, blocks in stacks:
        flip = blocks.shape[1] > blocks.shape[2]
        oriented = blocks.mT if flip else blocks
        buckets[(oriented.shape[1], oriented.shape[2])].append((key, oriented, flip))
    out: dict[Hashable, Tensor] = {}
    for items in buckets.values():
        for batch in _batches(items):
            O = newton_schulz(_stack_as(ns_dtype, [blocks for _, blocks, _ in batch]), steps)
            for (key, blocks, flip), o in zip(batch, O.split([blocks.shape[0] for _, blocks, _ in batch])):
                out[key] = o.mT if flip else o
    return out


def _stack_as(dtype: torch.dtype, blocks: list[Tensor]) -> Tensor:
    """torch.cat(blocks).to(dtype), cast while copying (cat into an output of that dtype): one read of the fp32
    blocks and one write in dtype."""
    out = torch.empty((sum(b.shape[0] for b in blocks), *blocks[0].shape[1:]), dtype=dtype, device=blocks[0].device)
    return torch.cat(blocks, out=out)


def _batches(items: list[tuple]) -> Iterable[list[tuple]]:
    """Split a bucket of (key, blocks, ...) into batches of at most NS_BATCH_ELEMENTS elements (at least one stack
    each)."""
    batch, size = [], 0
    for item in items:
        n = item[1].numel()
        if batch and size + n > NS_BATCH_ELEMENTS:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += n
    if batch:
        yield batch

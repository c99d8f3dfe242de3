"""`chunk_kda`: chunked KDA on raw layer inputs in Triton (training and prefill), forward and backward.

The stages, each in a file of its own (docs/kda-kernels.md, "Kernels by stage"):
- `chunk_prepare.py`: inside each 64-token chunk, all chunks in parallel: the gate and its in-chunk cumulative sum
  G, the q/k L2 norms and β, the scores Aqk and T = (I + Akk)⁻¹, W and U (the UT transform, docs/kda.md §3);
- `chunk_state.py`: the state handed from chunk to chunk, forward (`_state`) and backward (`_state_bwd`);
- `chunk_output.py`: a training forward's o from the states it stores (`_fwd_o`);
- `chunk_bwd.py`: the rest of the backward, value side, score side, gate and norms.
Launch settings are in `tuning.py`, the shared device helpers and the chunk plan in `chunk_common.py`. A forward
that no backward can follow runs `chunk_prefill.py` (16- or 32-token chunks) where that fills the GPU
(`prefill_applies`).

This file holds the drivers, `_fwd` and `_bwd` (which kernels run, in what order, on which buffers), the autograd
Function and the public `chunk_kda`. The gate g = g_min·σ(exp(A)·(z + dt_bias)), the q/k L2 norms (and q's scale)
and β = σ(b) are computed inside the kernels from the raw inputs, never materialised.

Storage (docs/kda-kernels.md, "Numerics"): intermediates are bf16 for bf16 inputs except U and Aqk (fp32 unless
all_bf16) and G and T (fp32); the chunk-start states, Ũ, dS_end and dŨ that the value-side backward reads are
bf16 as `TUNING["bwd_storage_bf16"]` names them; the states carried by the state passes and all accumulators are
fp32. Everything is indexed by packed document offsets (`cu_seqlens`, fla's convention); a dense batch is B
equal-length documents. On CPU the same kernels run in the Triton interpreter (`TRITON_INTERPRET=1`, set before
triton is imported).

Legend: B batch, T tokens, TT = B·T, H heads, K key dim, V value dim, N sequences, NT chunks, C chunk size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

from k3.ops import interpreting
from k3.ops.kda.chunk_bwd import _bwd_gate, _bwd_k_block, _bwd_norms, _bwd_vk, _bwd_vv
from k3.ops.kda.chunk_common import CHUNK, _check_device, backward_scratch, backward_storage, inter_dtypes, make_plan
from k3.ops.kda.chunk_output import _fwd_o, output_apart
from k3.ops.kda.chunk_prefill import prefill_applies, prefill_forward
from k3.ops.kda.chunk_prepare import _fwd_prepare
from k3.ops.kda.chunk_state import _fwd_state, _state_bwd, _state_products
from k3.ops.kda.tuning import TUNING, _launch_options


def _fwd(q, k, v, z, b, A_log, dt_bias, g_min, scale, h0, plan, want_ht, want_hs, dtypes, state_bf16,
         keep=False, training=False, qprime=False, norms_from_scores=False):
    """The forward: (o, final state or None, chunk-start states if want_hs else None, kept). training: a backward
    can follow (`_fwd_state`'s products).

    keep: also return what the backward would recompute, (W, Qg, Kd, Aqk, gc, T, hs, Ũ, G, Ã, ‖q‖, ‖k‖), for
    `_bwd(inter=…)`, with Q′ = Qg − Aqk·W in Qg's place if qprime (`_prep_wu`; the forward still reads Qg for o)
    and Ã only with norms_from_scores (else None); else kept is None. The states and Ũ = U − W·S (in
    `backward_storage`'s dtypes; the value-side backward reads Ũ instead of recomputing W·S) come from the `_state`
    launch, with the same `state_bf16` as `_bwd`'s recompute: storing them does not change the arithmetic, so the
    gradients are bit-identical either way.
    o too, except where `output_apart` says the kept forward computes it from the stored bf16 states and Ũ
    (`_fwd_o`); then it carries their rounding, and a forward that keeps nothing computes it inside `_state`.
    """
    W, U, Qg, Kd, Aqk, gc, Tm, norms, G, Qp, At = _fwd_prepare(q, k, v, z, b, A_log, dt_bias, g_min, scale, plan,
                                                               dtypes, store_t=keep, store_norms=keep,
                                                               qprime="apart" if keep and qprime else None,
                                                               store_at=keep and norms_from_scores)
    # the returned chunk-start states are fp32; kept only for the backward, in its storage dtype
    hs_dtype = backward_storage(q.dtype, "hs") if keep and not want_hs else torch.float32
    o_apart = output_apart(q.dtype, U.dtype, keep, want_hs) and plan.NT > 0
    o, ht, hs, ut = _fwd_state(W, U, Qg, Kd, Aqk, gc, h0, plan, v.dtype, write_o=not o_apart, want_ht=want_ht,
                               want_hs=want_hs or keep, state_bf16=state_bf16, want_ut=keep, training=training,
                               hs_dtype=hs_dtype, ut_dtype=backward_storage(q.dtype, "ut", U.dtype))
    if o_apart:
        TT, H, K = q.shape
        V = v.shape[-1]
        o = torch.empty_like(v)
        BV = min(V, TUNING["fwd_o_bv"])
        bf16, split = _state_products(state_bf16, training=True)
        loop = bool(TUNING["fwd_o_loop"])
        _fwd_o[(plan.NT * (1 if loop else V // BV), H)](Qg, Aqk, hs, ut, o, plan.cu, plan.chunk_idx, H=H, K=K, V=V,
                                                        BV=BV, C=CHUNK, BF16=bf16, SPLIT=split, LOOP=loop,
                                                        INTERP=interpreting(), **_launch_options("fwd_o"))
    # U is not needed by the backward
    kept = (W, Qg if Qp is None else Qp, Kd, Aqk, gc, Tm, hs, ut, G, At) + norms if keep else None
    return o, ht, (hs if want_hs else None), kept


def _bwd(q, k, v, z, b, A_log, dt_bias, g_min, scale, h0, plan, do, dht, dtypes, state_bf16, inter=None,
         qprime=False, norms_from_scores=False):
    """All gradients from the raw inputs and dO (and dht): recompute if needed, the state pass, the chunk passes.

    inter: the forward's (W, Qg, Kd, Aqk, gc, T, hs, Ũ, G, Ã, ‖q‖, ‖k‖) (`_fwd(keep=True)`); then nothing is recomputed
    and h0 is not used. Without it the prepare kernels and `_state` (storing G, the chunk-start states, Ũ and the
    norms) run again here. Then `_state_bwd`, the value side over key slices (`_bwd_vk`, `_bwd_vv`), the
    score backward per 16-row block and key slice (`_bwd_k_block`), the cumsum and gate chains per key slice and
    chunk (`_bwd_gate`) and the row-wise norm and σ' chains (`_bwd_norms`).
    The backward state pass multiplies as TUNING["state_bwd_products"] says (split bf16), whatever
    state_bf16 is: state_bf16 only changes the forward and the recomputed states.

    Variants (`TUNING`'s last section, read once per call): qprime (`state_bwd_qprime`): `_state_bwd` on
    Q′ = Qg − Aqk·W (inter's Qg is Q′ then, `_fwd(qprime=True)`), and the value side adds dŨ's Aqkᵀ·dO.
    norms_from_scores: the norm backward's and dβ's sums over K from the scores in `_bwd_vv`, so `_bwd_k_block`
    writes dq and dk and `_bwd_norms` does not run. `bwd_gate_fused`: `_bwd_gate`'s work in `_bwd_k_block`.
    `bwd_vv_fused`: `_bwd_vv`'s work in `_bwd_vk`.
    """
    TT, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    # checked first: a refused setting should not cost a recompute or the passes before it
    products = TUNING["state_bwd_products"]
    if products not in ("tf32", "split", "bf16"):
        raise ValueError(f"TUNING['state_bwd_products'] is tf32, split or bf16, not {products!r}")
    launch = _launch_options("state_bwd")
    if products != "tf32" and (launch["num_warps"] != 4 or launch.get("num_stages", 3) not in (2, 3)):
        raise ValueError(f"`_state_bwd` with {products} products was measured correct on the H200 at 4 warps and "
                         f"2-3 stages only, not {launch} (TUNING): with 1 stage the build computed wrong gradients "
                         "or faulted (docs/kda-kernels.md, 'Launch settings')")
    BCK = TUNING["bwd_k_rows"]
    if BCK not in (16, 32):
        raise ValueError(f"TUNING['bwd_k_rows'] is 16 or 32, not {BCK!r}")
    gate_fused = bool(TUNING["bwd_gate_fused"])
    if inter is None:
        # with qprime, Q′ over Qg: `_state` reads neither without o
        W, U, Qg, Kd, Aqk, gc, Tm, norms, G, _, At = _fwd_prepare(q, k, v, z, b, A_log, dt_bias, g_min, scale,
                                                                  plan, dtypes, store_t=True, store_norms=True,
                                                                  qprime="over" if qprime else None,
                                                                  store_at=norms_from_scores)
        _, _, hs, ut = _fwd_state(W, U, Qg, Kd, Aqk, gc, h0, plan, v.dtype, write_o=False, want_hs=True,
                                  state_bf16=state_bf16, want_ut=True, training=True,
                                  hs_dtype=backward_storage(q.dtype, "hs"),
                                  ut_dtype=backward_storage(q.dtype, "ut", U.dtype))
        del U
    else:
        W, Qg, Kd, Aqk, gc, Tm, hs, ut, G, At, *norms = inter
        del inter
        if norms_from_scores and At is None:
            raise ValueError("norms_from_scores needs the forward's Ã: `_fwd(keep=True, norms_from_scores=True)`")
        # chunk-start states the forward returned (fp32), rounded as the recompute would have stored them
        hs = hs.to(backward_storage(q.dtype, "hs"))
    BV = min(V, TUNING["state_bwd_bv"])
    NT = max(plan.NT, 1)
    du = torch.empty(TT, H, V, dtype=backward_storage(q.dtype, "du"), device=dev)
    dse = torch.empty(NT, H, K, V, dtype=backward_storage(q.dtype, "dse"), device=dev)
    dh0 = torch.empty(plan.N, H, K, V, dtype=torch.float32, device=dev)
    interp = interpreting()
    qn, kn = norms
    _state_bwd[(V // BV, plan.N * H)](Qg, Kd, Aqk, W, gc, do, dht if dht is not None else dh0, du, dse, dh0,
                                      plan.cu, plan.chunk_off, H=H, K=K, V=V, BV=BV, C=CHUNK,
                                      USE_DHT=dht is not None, BF16=products == "bf16", SPLIT=products == "split",
                                      QPRIME=qprime, INTERP=interp, **launch)
    aqk = Aqk if qprime or norms_from_scores else gc  # the value side reads Aqk only with these
    del W, Qg, Kd, Aqk  # (kept ones live on in the autograd context until the backward returns)
    dv = torch.empty_like(v)
    # the value side's dq̂, dk̂, finished by the score side (`bwd_scratch_bf16`)
    dqh = torch.empty(TT, H, K, dtype=backward_scratch(q.dtype, "bwd_scratch_bf16"), device=dev)
    dkh = torch.empty_like(dqh)
    dG = torch.empty(NT, H, CHUNK, K, dtype=torch.float32, device=dev)
    daqk = torch.empty(TT, H, CHUNK, dtype=backward_scratch(q.dtype, "bwd_da_bf16"), device=dev)
    dakk = torch.empty_like(daqk)
    dq, dk, dz = torch.empty_like(q), torch.empty_like(k), torch.empty_like(z)
    db = torch.empty_like(b)
    SK = min(K, TUNING["bwd_k_cols"])
    NS = K // SK
    # the gate chain on `_bwd_k_block`'s key slices when it runs there (bwd_gate_fused)
    SKG = SK if gate_fused else min(K, TUNING["bwd_gate_cols"])
    NSG = K // SKG
    dA_part = torch.zeros(NT, H, NSG, dtype=torch.float32, device=dev)
    dbias_part = torch.zeros(NT, H, K, dtype=torch.float32, device=dev)
    if plan.NT > 0:
        # the value side over key slices from Ũ; dβ leaves each slice as a partial for `_bwd_vv`
        SKV = min(K, TUNING["bwd_vk_cols"])
        NSV = K // SKV
        dbk = torch.empty(plan.NT, H, NSV, CHUNK, dtype=torch.float32, device=dev)
        # with norms_from_scores: the value side's parts of ⟨q̂, dq̂⟩ and ⟨k̂, dk̂⟩ per slice, then `_bwd_vv`'s sums
        # and the β logit's gradient; else dβ before σ' for `_bwd_norms`
        nd = torch.empty(plan.NT, H, NSV, 2, CHUNK, dtype=torch.float32, device=dev) if norms_from_scores else dbk
        nrm = torch.empty(TT, H, 2, dtype=torch.float32, device=dev) if norms_from_scores else dbk
        dbeta = db if norms_from_scores else torch.empty(TT, H, dtype=torch.float32, device=dev)
        # fp32 loop tiles take twice the shared memory per stage: their own launch (TUNING)
        fp32_tiles = torch.float32 in (hs.dtype, dse.dtype, du.dtype, ut.dtype)
        vk_launch = _launch_options("bwd_vk")
        if fp32_tiles:
            vk_launch["num_stages"] = TUNING["bwd_vk_fp32_stages"]
        # K = 16 with BV = 32 faulted (an illegal address) on the H200; BV = 16 runs
        BVK = min(V, TUNING["bwd_vk_fp32_bv" if fp32_tiles else "bwd_vk_bv"]) if K > 16 else 16
        # with bwd_vv_fused, the key slices of a chunk count themselves here (`_bwd_vk`)
        vv_fused = bool(TUNING["bwd_vv_fused"])
        slices_done = torch.zeros(plan.NT, H, dtype=torch.int32, device=dev) if vv_fused else dbk
        at = aqk if At is None else At
        BVV = min(V, TUNING["bwd_vv_bv"])
        _bwd_vk[(plan.NT * NSV, H)](q, k, b, G, gc, qn, kn, plan.cu, plan.chunk_idx, Tm, hs, dse, do, du, ut, aqk,
                                    dqh, dkh, dG, dbk, nd, v, at, dv, daqk, dakk, dbeta, nrm, slices_done, scale,
                                    H=H, K=K, V=V, SK=SKV, BV=BVK, C=CHUNK, QPRIME=qprime,
                                    ROW_DOTS=norms_from_scores, VV=vv_fused, BVV=BVV, INTERP=interp, **vk_launch)
        if not vv_fused:
            _bwd_vv[(plan.NT, H)](v, b, plan.cu, plan.chunk_idx, Tm, do, du, ut, aqk, dbk, at, nd, dv, daqk, dakk,
                                  dbeta, nrm, H=H, V=V, NS=NSV, BV=BVV, C=CHUNK, QPRIME=qprime,
                                  NORMS=norms_from_scores, INTERP=interp, **_launch_options("bwd_vv"))
        del dbk, nd, ut, aqk, At, at, slices_done
        # per (16-row block, key slice): the score side; then per (key slice, chunk) the reverse cumsum and the
        # gate chain, and per row the norm and σ' chains (in `_bwd_k_block` and `_bwd_vv` with norms_from_scores)
        db_part = nrm if norms_from_scores else torch.empty(TT, H, NS, dtype=torch.float32, device=dev)
        # with bwd_gate_fused, the blocks of a chunk count themselves per key slice here (`_bwd_k_block`)
        blocks_done = torch.zeros(plan.NT, H, NS, dtype=torch.int32, device=dev) if gate_fused else db_part
        _bwd_k_block[(plan.NT * NS * (CHUNK // BCK), H)](q, k, b, G, qn, kn, plan.cu, plan.chunk_idx, dqh, dkh, dG,
                                                         daqk, dakk, db_part, nrm, dq, dk, z, A_log, dt_bias, dz,
                                                         dA_part, dbias_part, blocks_done, scale, H=H, K=K, SK=SK,
                                                         C=CHUNK, BC=BCK, NORMS=norms_from_scores, GATE=gate_fused,
                                                         G_MIN=g_min, INTERP=interp, **_launch_options("bwd_k"))
        del G, blocks_done
        if not gate_fused:
            _bwd_gate[(plan.NT * NSG, H)](z, A_log, dt_bias, plan.cu, plan.chunk_idx, dG, dz, dA_part, dbias_part,
                                          H=H, K=K, SK=SKG, C=CHUNK, G_MIN=g_min, INTERP=interp,
                                          **_launch_options("bwd_gate"))
        if not norms_from_scores:
            BT = TUNING["bwd_norms_rows"]
            _bwd_norms[(triton.cdiv(TT, BT), H)](q, k, b, qn, kn, dqh, dkh, dbeta, db_part, dq, dk, db, TT, scale,
                                                 H=H, K=K, NS=NS, BT=BT, INTERP=interp,
                                                 **_launch_options("bwd_norms"))
    else:
        dv.zero_()
    dA_log = dA_part.sum((0, 2)).to(A_log.dtype)
    ddt_bias = dbias_part.sum(0).reshape(-1).to(dt_bias.dtype)
    return dq, dk, dv, dz, db, dA_log, ddt_bias, dh0


class ChunkKDAFunction(torch.autograd.Function):
    """Autograd wrapper. With `keep` it saves the raw inputs and the forward's chunk operands, chunk-start
    states and Ũ (`_fwd(keep=True)`; not h0), and the backward recomputes nothing; without, only the raw inputs and
    h0, and the backward recomputes them. Everything goes through `save_for_backward`, so saved-tensor hooks
    (non-reentrant activation checkpointing, offloading) and the in-place checks cover it."""

    @staticmethod
    def forward(ctx, q, k, v, z, b, A_log, dt_bias, h0, g_min, scale, plan, want_ht, want_hs, dtypes, state_bf16,
                keep, training):
        # decided once for both passes: the kept operands are Q′ or Q⊙Γ, with Ã or without, by them
        qprime = bool(TUNING["state_bwd_qprime"])
        norms_from_scores = bool(TUNING["norms_from_scores"])
        o, ht, hs, kept = _fwd(q, k, v, z, b, A_log, dt_bias, g_min, scale, h0, plan, want_ht, want_hs, dtypes,
                               state_bf16, keep=keep, training=training, qprime=qprime,
                               norms_from_scores=norms_from_scores)
        if kept is None:
            ctx.save_for_backward(q, k, v, z, b, A_log, dt_bias, h0)
        else:
            ctx.save_for_backward(q, k, v, z, b, A_log, dt_bias, *kept)
        ctx.cfg = (g_min, scale, plan, dtypes, state_bf16, kept is not None, h0 is not None, qprime,
                   norms_from_scores)
        ctx.mark_non_differentiable(*(x for x in (hs,) if x is not None))
        return o, ht, hs

    @staticmethod
    def backward(ctx, do, dht, dhs):
        g_min, scale, plan, dtypes, state_bf16, kept, has_h0, qprime, norms_from_scores = ctx.cfg
        saved = ctx.saved_tensors
        q, k, v, z, b, A_log, dt_bias = saved[:7]
        h0, inter = (None, saved[7:]) if kept else (saved[7], None)
        del saved
        dq, dk, dv, dz, db, dA_log, ddt_bias, dh0 = _bwd(q, k, v, z, b, A_log, dt_bias, g_min, scale, h0, plan,
                                                          do.contiguous(),
                                                          None if dht is None else dht.contiguous(),
                                                          dtypes, state_bf16, inter=inter, qprime=qprime,
                                                          norms_from_scores=norms_from_scores)
        return (dq, dk, dv, dz, db, dA_log, ddt_bias, dh0 if has_h0 else None) + (None,) * 9


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    z: torch.Tensor,
    beta_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    gate_lower_bound: float = -5.0,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_host: Sequence[int] | None = None,
    return_chunk_states: bool = False,
    all_bf16: bool = False,
    state_bf16: bool = False,
    save_intermediates: bool = True,
):
    """Chunked KDA on raw inputs, with the gate, q/k L2 norms and β sigmoid fused in. Differentiable.

    q, k: [B, T, H, K] after the short conv + SiLU, not normalised; v: [B, T, H, V]; z: [B, T, H, K] decay
    logits before dt_bias; beta_logits: [B, T, H]; A_log: [H]; dt_bias: [H*K] (or [H, K]); bf16 or fp32.
    gate_lower_bound: g_min ∈ [−5, 0). scale multiplies q̂ (default K**-0.5). initial_state:
    [N, H, K, V] (N = B, or the number of documents with cu_seqlens [N+1], B = 1).
    Returns o [B, T, H, V] in v's dtype and the final state [N, H, K, V] fp32 (None unless
    output_final_state); with return_chunk_states also the states at every 64-token chunk start,
    [NT, H, K, V] fp32, chunks numbered document by document (not differentiable).
    cu_seqlens_host: the same offsets as host ints when the caller has them (`SequenceLayout.offsets`):
    planning then never reads `cu_seqlens` back from the GPU (a sync per call).
    all_bf16 / state_bf16 select the faster, less accurate variants measured in docs/kda-kernels.md.
    When no backward can follow, the forward runs the 32- or 16-token inference kernels (`chunk_prefill.py`) if
    `prefill_applies` (enough programs to fill the GPU), else the 64-token ones; both return the same things.

    save_intermediates (the model's `kda_save_intermediates`) trades memory for
    backward time. Only when a backward can follow (grad mode on and some input requires grad; never for
    inference or prefill) the forward keeps, until the backward has run, what the backward would otherwise
    recompute with the prepare kernels and `_state` (same kernels, same inputs: bit-identical gradients).
    Per call, with TT = B·T tokens and NT chunks (NT = ⌈T/64⌉·B dense; per document with cu_seqlens):
      W, Q⊙Γ, K⊙exp(G_C − G)   3 × [TT, H, K]    bf16 (fp32 for fp32 inputs)
      Aqk                      [TT, H, 64]       fp32 (bf16 with all_bf16)
      T = (I + Akk)⁻¹          [TT, H, 64]       fp32
      G_C                      [NT, H, K]        fp32
      G (in-chunk cumsum)      [TT, H, K]        fp32
      chunk-start states       [NT, H, K, V]     bf16 (TUNING["bwd_storage_bf16"]; fp32 for fp32 inputs, and
                                                 the returned fp32 ones if return_chunk_states)
      Ũ = U − W·S              [TT, H, V]        bf16 (the same switch; else U's dtype)
      ‖q‖, ‖k‖                 2 × [TT, H]       fp32
      Ã (Akk before β)         [TT, H, 64]       bf16 (fp32 for fp32 inputs); only with
                                                 TUNING["norms_from_scores"] (+96 MiB below)
    At the K3 shape (T = 8192, H = 96, K = V = 128, bf16, no all_bf16) that is 576 + 192 + 192 + 6 + 384 + 384 +
    192 MiB ≈ 1.88 GiB per layer (the states are the largest part: 2·K·V/64 = 512 B per token and head), in
    exchange for the recompute of the prepare and `_state` (docs/kda-kernels.md, "Measurements").
    initial_state is then not saved. The kept W, Q⊙Γ, K⊙exp(G_C − G), Aqk and Ũ are released when the
    backward returns (autograd frees saved tensors only then), not after the state pass as the recomputed ones
    are. With return_chunk_states the returned states are the saved ones: modifying them in place before the
    backward makes autograd raise instead of computing wrong gradients. Keeping also changes how o is computed
    for bf16 inputs (`TUNING["state_o_apart"]`): from the kept bf16 states and Ũ after `_state`, which is faster
    and rounds o's inputs once more; so o with and without save_intermediates agrees to o's tolerance, not to the
    bit, while the gradients stay bit-identical.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape or z.shape != q.shape:
        raise ValueError(f"k and z must match q {tuple(q.shape)}, got {tuple(k.shape)} and {tuple(z.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    V = v.shape[-1]
    if beta_logits.shape != q.shape[:3]:
        raise ValueError(f"beta_logits must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta_logits.shape)}")
    if A_log.numel() != H or dt_bias.numel() != H * K:
        raise ValueError(f"A_log must have {H} and dt_bias {H * K} entries, got {A_log.numel()}, {dt_bias.numel()}")
    for name, d in (("K", K), ("V", V)):
        if d < 16 or d > 256 or d & (d - 1):
            raise ValueError(f"{name} must be a power of two in [16, 256], got {d}")
    if not -5.0 <= gate_lower_bound < 0.0:
        raise ValueError(f"gate_lower_bound must be in [-5, 0) (16-token tiles stay in range), got {gate_lower_bound}")
    _check_device(q, k, v, z, beta_logits, A_log, dt_bias)
    plan = make_plan(B, T, cu_seqlens, q.device, cu_seqlens_host)
    if initial_state is not None and initial_state.shape != (plan.N, H, K, V):
        raise ValueError(f"initial_state must be [N, H, K, V] = [{plan.N}, {H}, {K}, {V}], "
                         f"got {tuple(initial_state.shape)}")
    scale = K**-0.5 if scale is None else float(scale)

    def flat(x):
        return x.reshape(B * T, *x.shape[2:]).contiguous()

    h0 = None if initial_state is None else initial_state.float().contiguous()
    training = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, z, beta_logits, A_log, dt_bias, initial_state))
    keep = bool(save_intermediates) and training
    raw = (flat(q), flat(k), flat(v), flat(z), flat(beta_logits), A_log.contiguous(), dt_bias.reshape(-1).contiguous())
    dtypes = inter_dtypes(q.dtype, all_bf16)
    # the inference forward in 32- or 16-token chunks (`chunk_prefill.py`)
    if not training and prefill_applies(plan, H, V, q.device):
        o, ht, hs = prefill_forward(*raw, float(gate_lower_bound), scale, h0, plan, output_final_state,
                                    return_chunk_states, dtypes, state_bf16)
    else:
        o, ht, hs = ChunkKDAFunction.apply(*raw, h0, float(gate_lower_bound), scale, plan, output_final_state,
                                           return_chunk_states, dtypes, state_bf16, keep, training)
    o = o.view(B, T, H, V)
    if return_chunk_states:
        return o, ht, hs[: plan.NT]
    return o, ht

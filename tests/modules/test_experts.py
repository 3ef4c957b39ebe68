"""GroupedExperts and convert_model on transformers' mixture-of-experts models."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import lowprec
from lowprec.linear.function import quantized_linear
from lowprec.modules.experts import _is_silu
from lowprec.recipe.recipes import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

transformers = pytest.importorskip("transformers")

H, I, E, K, T = 64, 96, 4, 2, 48


def _models():
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig
    common = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)
    return {
        "mixtral": (MixtralConfig(intermediate_size=I, num_local_experts=E,
                                  num_experts_per_tok=K, **common), "MixtralForCausalLM"),
        "qwen3_moe": (Qwen3MoeConfig(moe_intermediate_size=I, intermediate_size=I,
                                     num_experts=E, num_experts_per_tok=K, head_dim=16,
                                     **common), "Qwen3MoeForCausalLM"),
        "deepseek_v3": (DeepseekV3Config(moe_intermediate_size=I, intermediate_size=I,
                                         n_routed_experts=E, num_experts_per_tok=K,
                                         n_group=1, topk_group=1, first_k_dense_replace=0,
                                         q_lora_rank=None, kv_lora_rank=16,
                                         qk_rope_head_dim=8, qk_nope_head_dim=8,
                                         v_head_dim=16, **common), "DeepseekV3ForCausalLM"),
    }


def _build(name):
    cfg, cls = _models()[name]
    torch.manual_seed(0)
    # the transformers per-expert loop (its default may pick torch._grouped_mm)
    return getattr(transformers, cls)._from_config(cfg, experts_implementation="eager").to(
        torch.bfloat16)


def _experts_of(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


def _routing(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[:5] = 0  # one expert busier, one maybe idle
    w = torch.rand(T, K, generator=g)
    return x, idx, w


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_grouped_experts_equal_transformers_loop(name):
    hf = _experts_of(_build(name))[0]
    with torch.no_grad():
        hf.gate_up_proj.normal_(std=0.05)
        hf.down_proj.normal_(std=0.05)
    lp = lowprec.GroupedExperts.from_experts(copy.deepcopy(hf), "experts")
    # transformers' default gating is the module's own silu(gate) * up (the SwiGLU kernels)
    assert lp.apply_gate is None and _is_silu(lp.act_fn)
    x, idx, w = _routing()
    outs, grads = [], []
    for mod in (hf, lp):
        xx = x.clone().requires_grad_(True)
        y = mod(xx, idx, w)
        y.float().square().sum().backward()
        outs.append(y)
        grads.append((xx.grad, mod.gate_up_proj.grad, mod.down_proj.grad))
    assert torch.equal(outs[0], outs[1])
    # the weight gradients sum each expert's rows in another order (token-major here,
    # top-k slot-major in the loop): equal to bf16 rounding
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_convert_model_swaps_experts_keeping_parameters(name):
    model = _build(name)
    before = {id(m.gate_up_proj): m for m in _experts_of(model)}
    keys = set(model.state_dict())
    lowprec.convert_model(model, module_filter_fn=lambda m, fqn: "lm_head" not in fqn)
    experts = [m for m in model.modules() if isinstance(m, lowprec.GroupedExperts)]
    assert len(experts) == len(before) == 2
    assert all(id(m.gate_up_proj) in before for m in experts)
    # the same parameter names (lowprec modules add their scaling state as _extra_state)
    assert {k for k in model.state_dict() if not k.endswith("_extra_state")} == keys
    assert all(fqn.endswith("experts") for fqn in model.lowprec_conversion["converted"]
               if "proj" not in fqn.rsplit(".", 1)[-1])
    ids = torch.randint(0, 128, (2, 16))
    with lowprec.autocast(recipe=Float8CurrentScaling(fp8_format=Format.E4M3)):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(m.gate_up_proj.grad is not None and m.down_proj.grad.abs().sum() > 0
               for m in experts)


def _per_expert_reference(mod, x, idx, w, qs):
    """The experts as one quantized Linear per expert and GEMM (the transformers loop), each
    token's rows summed on the CPU (in expert order; a GPU's index_add_ adds in no fixed
    order)."""
    out = torch.zeros_like(x, device="cpu")
    for e in range(mod.num_experts):
        pos, tok = torch.where((idx == e).t())
        order = torch.argsort(tok, stable=True)
        pos, tok = pos[order], tok[order]
        h = quantized_linear(x[tok], mod.gate_up_proj[e], quantizers=qs[e])
        gate, up = h.chunk(2, dim=-1)
        o = quantized_linear(mod.act_fn(gate) * up, mod.down_proj[e],
                             quantizers=qs[mod.num_experts + e])
        out.index_add_(0, tok.cpu(), (o * w[tok, pos, None]).to(x.dtype).cpu())
    return out.to(x.device)


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), MXFP8BlockScaling()],
                         ids=["current", "mxfp8"])
def test_quantized_experts_equal_per_expert_linears(recipe):
    torch.manual_seed(0)
    mod = lowprec.GroupedExperts(E, H, I, params_dtype=torch.bfloat16, name="experts")
    x, idx, w = _routing(1)
    with lowprec.autocast(recipe=recipe):
        got = mod(x, idx, w)
        qs, _, _ = mod.gemm_quantizers(x.device)
        ref = _per_expert_reference(mod, x, idx, w, qs)
    assert torch.equal(got, ref)


@pytest.mark.skipif(not (torch.cuda.is_available()
                         and torch.cuda.get_device_capability() >= (9, 0)),
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(fp8_format=Format.E4M3),
                                    MXFP8BlockScaling()], ids=["current-e4m3", "mxfp8"])
def test_gpu_experts_laid_out_in_blocks_match_per_expert_linears(recipe):
    """On Hopper the routed rows go into the grouped paths' block layout (zero rows after
    each expert): the output equals the per-expert Linears bit for bit (the FP8 grouped
    GEMM is lowprec's Triton kernel at these small experts); gradients reach every
    expert."""
    torch.manual_seed(0)
    mod = lowprec.GroupedExperts(E, 256, 128, params_dtype=torch.bfloat16, name="experts",
                                 device="cuda")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, 256, generator=g).bfloat16().cuda()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).cuda()
    idx[:5] = 0
    w = torch.rand(T, K, generator=g).cuda()
    with lowprec.autocast(recipe=recipe):
        got = mod(x, idx, w)
        qs, _, _ = mod.gemm_quantizers(x.device)
        ref = _per_expert_reference(mod, x, idx, w, qs)
    assert torch.equal(got, ref)
    xx = x.clone().requires_grad_(True)
    with lowprec.autocast(recipe=recipe):
        mod(xx, idx, w).float().sum().backward()
    assert xx.grad.abs().sum() > 0 and mod.gate_up_proj.grad.abs().sum() > 0
    assert torch.isfinite(mod.down_proj.grad).all()


@pytest.mark.skipif(not (torch.cuda.is_available()
                         and torch.cuda.get_device_capability() >= (9, 0)),
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling(fp8_format=Format.E4M3)],
                         ids=["bf16", "current-e4m3"])
def test_gpu_top8_experts_sum_each_token_in_expert_order(recipe):
    """Eight rows a token (16 experts, top-8): each token's sum is the per-expert Linears'
    added in expert order, the same bits on every call (no atomics)."""
    torch.manual_seed(0)
    experts, k = 16, 8
    mod = lowprec.GroupedExperts(experts, 256, 128, params_dtype=torch.bfloat16,
                                 name="experts", device="cuda")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, 256, generator=g).bfloat16().cuda()
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(T)]).cuda()
    w = torch.rand(T, k, generator=g).cuda()
    with lowprec.autocast(recipe=recipe) if recipe else contextlib.nullcontext():
        got = mod(x, idx, w)
        again = mod(x, idx, w)
        qs, _, _ = mod.gemm_quantizers(x.device)
        ref = _per_expert_reference(mod, x, idx, w, qs or [None] * (2 * experts))
    assert torch.equal(got, again) and torch.equal(got, ref)


def test_compiled_experts_bit_identical():
    torch.manual_seed(0)
    mod = lowprec.GroupedExperts(E, H, I, params_dtype=torch.bfloat16, name="experts")
    x, idx, w = _routing(2)
    recipe = Float8CurrentScaling()

    def step(m, xx):
        with lowprec.autocast(recipe=recipe):
            return m(xx, idx, w)

    eager = step(mod, x)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(mod, x)
    assert torch.equal(eager, compiled)


def test_delayed_scaling_experts_update_their_state():
    torch.manual_seed(0)
    mod = lowprec.GroupedExperts(E, H, I, params_dtype=torch.bfloat16, name="experts")
    x, idx, w = _routing(3)
    for _ in range(2):
        with lowprec.autocast(recipe=DelayedScaling()):
            y = mod(x.clone().requires_grad_(True), idx, w)
        y.float().sum().backward()
    state = mod.scaling_state()
    for mode in ("forward", "backward"):  # every expert's amaxes entered the history
        hist = [t for name, t in state[mode].items() if "amax_history" in name]
        assert hist and all(bool((h > 0).any()) for h in hist), (mode, list(state[mode]))


def test_meta_init_and_errors():
    mod = lowprec.GroupedExperts(E, H, I, device="meta")
    mod.to_empty(device="cpu")
    mod.reset_parameters()
    assert mod.gate_up_proj.abs().max() <= 1 / H ** 0.5
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        lowprec.GroupedExperts(0, H, I)
    with lowprec.quantized_model_init(recipe=Float8CurrentScaling()):
        with pytest.raises(ValueError, match="outside quantized_model_init"):
            lowprec.GroupedExperts(E, H, I)


def _titan_experts(version):
    """torchtitan's GroupedExperts of ``version`` (0.2: the one lowprec's torchtitan
    converter targets, in the test extra; 0.3 where installed)."""
    try:
        if version == "0.2":
            from torchtitan.models.moe.moe import GroupedExperts
            m = GroupedExperts(dim=H, hidden_dim=I, num_experts=E, use_grouped_mm=False)
        else:
            from torchtitan.models.common.moe import GroupedExperts
            m = GroupedExperts(GroupedExperts.Config(dim=H, hidden_dim=I, num_experts=E))
    except Exception as err:  # noqa: BLE001 - torchtitan (and what it imports) not there
        pytest.skip(f"torchtitan {version}'s MoE does not import: {err}")
    torch.manual_seed(0)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return m


@pytest.mark.parametrize("version", ["0.2", "0.3"])
def test_torchtitan_experts_converted_and_equal(version):
    """torchtitan's GroupedExperts: convert_model swaps in TorchtitanGroupedExperts with the
    same parameters under the same names; high precision equals torchtitan's own forward
    bit for bit."""
    titan = _titan_experts(version)
    holder = torch.nn.ModuleDict({"experts": titan})
    ref = copy.deepcopy(titan)
    names = [n for n, _ in titan.named_parameters()]
    lowprec.convert_model(holder)
    lp = holder["experts"]
    assert isinstance(lp, lowprec.modules.experts.TorchtitanGroupedExperts)
    assert [n for n, _ in lp.named_parameters()] == names
    assert all(getattr(lp, n) is getattr(titan, n) for n in names)
    x, counts = torch.randn(40, H), torch.tensor([10, 0, 25, 5])
    assert torch.equal(lp(x, counts), ref(x, counts))
    with lowprec.autocast(recipe=Float8CurrentScaling()):
        y = lp(x.clone().requires_grad_(True), counts)
    y.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lp.parameters())


def test_torchtitan_layout_quantized_equals_per_expert_linears():
    """TorchtitanGroupedExperts' three GEMMs under FP8 current scaling against one quantized
    Linear per expert and GEMM (bit for bit on the CPU)."""
    params = {n: torch.nn.Parameter(torch.randn(E, *s) * 0.05) for n, s in
              (("w1_EFD", (I, H)), ("w2_EDF", (H, I)), ("w3_EFD", (I, H)))}
    src = torch.nn.Module()
    for n, p in params.items():
        setattr(src, n, p)
    lp = lowprec.modules.experts.TorchtitanGroupedExperts.from_experts(src, "titan")
    sizes = [9, 0, 20, 11]
    x = torch.randn(sum(sizes), H)
    with lowprec.autocast(recipe=Float8CurrentScaling()):
        got = lp(x, torch.tensor(sizes))
        qs, _, _ = lp.gemm_quantizers(x.device)
    xs = torch.split(x.bfloat16(), sizes)
    ref = []
    for g in range(E):
        w1, w3, w2 = (params[n][g].bfloat16() for n in ("w1_EFD", "w3_EFD", "w2_EDF"))
        h = torch.nn.functional.silu(quantized_linear(xs[g], w1, quantizers=qs[g])) * \
            quantized_linear(xs[g], w3, quantizers=qs[E + g])
        ref.append(quantized_linear(h, w2, quantizers=qs[2 * E + g]))
    assert torch.equal(got, torch.cat(ref).float())


def test_model_gating_is_kept():
    """An experts class with its own gating (DeepSeek-V4 clamps gate and up to
    swiglu_limit) is converted with that gating: equal to transformers' loop."""
    try:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
    except ImportError as err:
        pytest.skip(f"this transformers has no DeepSeek-V4: {err}")
    cfg = transformers.DeepseekV4Config(hidden_size=H, moe_intermediate_size=I,
                                        n_routed_experts=E, num_experts_per_tok=K,
                                        swiglu_limit=0.5)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    hf = DeepseekV4Experts(cfg).to(torch.bfloat16)
    with torch.no_grad():
        hf.gate_up_proj.normal_(std=0.2)
        hf.down_proj.normal_(std=0.2)
    holder = torch.nn.ModuleDict({"experts": copy.deepcopy(hf)})
    lowprec.convert_model(holder)
    assert isinstance(holder["experts"], lowprec.GroupedExperts)
    x, idx, w = _routing(4)
    assert torch.equal(holder["experts"](x, idx, w), hf(x, idx, w))


def test_expert_parallel_sentinel_refused():
    mod = lowprec.GroupedExperts(E, H, I, params_dtype=torch.bfloat16)
    x, idx, w = _routing(5)
    idx[0, 0] = E  # transformers' expert-parallel id for another rank's expert
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 4\)"):
        mod(x, idx, w)


def test_expert_parallel_modules_not_converted():
    model = _build("mixtral")
    for m in _experts_of(model):
        m._is_expert_parallel = True
    lowprec.convert_model(model)
    assert not any(isinstance(m, lowprec.GroupedExperts) for m in model.modules())


def test_router_linear_stays_high_precision():
    """A Linear named ``gate`` beside routed experts (an MoE block's router) is left as it is,
    with the reason in the conversion report."""
    block = torch.nn.Module()
    block.gate = torch.nn.Linear(H, E, bias=False)
    block.experts = _experts_of(_build("mixtral"))[0]
    block.shared = torch.nn.Linear(H, H)
    model = torch.nn.ModuleDict({"moe": block})
    lowprec.convert_model(model)
    assert type(block.gate) is torch.nn.Linear
    assert "router" in model.lowprec_conversion["skipped"]["moe.gate"]
    assert isinstance(block.shared, lowprec.Linear)
    assert isinstance(block.experts, lowprec.GroupedExperts)


_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.skipif(_TORCH < (2, 13), reason=(
    "torch 2.11's aot_eager is not bit-identical to eager on this model's own ops: with no "
    "recipe (F.linear, the bf16 experts) the attention projections' gradients already "
    "differ (v_proj by 4.9e-4); the experts alone compile bit-identically "
    "(test_compiled_experts_bit_identical)"))
def test_converted_model_compiles_fullgraph_bit_identical():
    """A converted transformers MoE model under torch.compile(fullgraph=True): no graph
    break, loss, logits and the experts' gradients bit-identical to eager."""
    model = _build("mixtral")
    lowprec.convert_model(model, module_filter_fn=lambda m, fqn: "lm_head" not in fqn)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    recipe = Float8CurrentScaling()

    def step(m):
        with lowprec.autocast(recipe=recipe):
            out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = [p.grad.clone() for n, p in model.named_parameters() if "experts" in n]
        model.zero_grad(set_to_none=True)
        return out.loss.detach(), out.logits.detach(), grads

    eager = step(model)
    compiled = step(torch.compile(model, fullgraph=True, backend="aot_eager"))
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])
    assert all(torch.equal(a, b) for a, b in zip(eager[2], compiled[2]))


class MixtralExperts(torch.nn.Module):
    """transformers 5.17's Mixtral experts: the same parameters and loop, none of the later
    experts interface's attributes (``has_gate``, ``_apply_gate``, ...)."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.act_fn = torch.nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(E):
            tok, pos = torch.where(top_k_index == e)
            gate, up = torch.nn.functional.linear(hidden_states[tok],
                                                  self.gate_up_proj[e]).chunk(2, dim=-1)
            h = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
            out.index_add_(0, tok, (h * top_k_weights[tok, pos, None]).to(out.dtype))
        return out


def test_experts_without_the_interface_attributes_converted_by_name():
    """Releases before transformers' experts interface (the GPU machine's 5.17): the
    plain-gating classes are converted; an unknown class without ``_apply_gate`` is not
    (its gating may be its own)."""
    torch.manual_seed(0)
    holder = torch.nn.ModuleDict({"experts": MixtralExperts().to(torch.bfloat16)})
    x, idx, w = _routing(5)
    ref = holder["experts"](x, idx, w)
    lowprec.convert_model(holder)
    assert isinstance(holder["experts"], lowprec.GroupedExperts)
    assert torch.equal(holder["experts"](x, idx, w), ref)

    class CustomExperts(MixtralExperts):
        pass
    other = torch.nn.ModuleDict({"experts": CustomExperts()})
    lowprec.convert_model(other)
    assert type(other["experts"]) is CustomExperts


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(fp8_format=Format.E4M3),
                                    MXFP8BlockScaling()], ids=["current-e4m3", "mxfp8"])
def test_quantized_experts_gradients_equal_per_expert_linears(recipe):
    """Input and weight gradients through the block layout of the routed rows equal one
    quantized Linear per expert (CPU: the same GEMMs)."""
    torch.manual_seed(0)
    mod = lowprec.GroupedExperts(E, H, I, params_dtype=torch.bfloat16, name="experts")
    x, idx, w = _routing(6)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).bfloat16()

    def grads(fn):
        xx = x.clone().requires_grad_(True)
        mod.zero_grad(set_to_none=True)
        with lowprec.autocast(recipe=recipe):
            fn(xx).backward(dy)
        return xx.grad, mod.gate_up_proj.grad, mod.down_proj.grad
    got = grads(lambda xx: mod(xx, idx, w))
    with lowprec.autocast(recipe=recipe):
        qs, _, _ = mod.gemm_quantizers(x.device)
    ref = grads(lambda xx: _per_expert_reference(mod, xx, idx, w, qs))
    assert got[0] is not None and got[0].abs().sum() > 0
    assert torch.equal(got[0], ref[0])
    for a, b in zip(got[1:], ref[1:]):  # wgrad sums the rows in another order
        torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(fp8_format=Format.E4M3),
                                    MXFP8BlockScaling()], ids=["current-e4m3", "mxfp8"])
def test_padded_rows_do_not_reach_other_tokens(recipe):
    """The zero rows between experts' groups add nothing to any token, even when the
    expert they pad holds NaN; an expert no token is routed to changes no output; no
    tokens at all run too."""
    torch.manual_seed(0)
    mod = lowprec.GroupedExperts(E, H, I, params_dtype=torch.bfloat16, name="experts")
    x, idx, w = _routing(7)
    idx[idx == E - 1] = 0  # the last expert (which takes the layout's slack) gets no token
    with lowprec.autocast(recipe=recipe):
        ref = mod(x, idx, w)
        with torch.no_grad():
            mod.down_proj[E - 1, 0, 0] = float("nan")
        got = mod(x, idx, w)
        empty = mod(x[:0], idx[:0], w[:0])
    assert torch.equal(got, ref) and torch.isfinite(got).all()
    assert empty.shape == (0, H)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs a GPU"))])
@pytest.mark.parametrize("padded", [False, True])
def test_routed_rows_gradient_is_indexings(device, padded):
    """The routed rows' backward (each token's rows summed in expert order, one pass on a
    GPU) gives the bits of indexing's own backward, top-8 over 300 tokens; padded rows
    (token T, holding NaN) reach no token."""
    from lowprec.modules.experts import _RoutedRows
    g = torch.Generator().manual_seed(3)
    tokens, k, h = 300, 8, 200
    idx = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(tokens)]).view(-1)
    token_of = (torch.argsort(idx, stable=True) // k).to(device)
    if padded:  # a padded row after every 37th routed row
        token_of = torch.cat([token_of.view(-1, 1)[: 37 * 64].view(64, 37),
                              torch.full((64, 1), tokens, device=device)], 1).view(-1)
        token_of = torch.cat([token_of, torch.argsort(idx, stable=True)[37 * 64:].to(device)
                              // k])
    rows = torch.arange(token_of.numel(), device=device)
    live = token_of < tokens
    rows_of = torch.stack([rows[live & (token_of == t)] for t in range(tokens)])
    hs = torch.randn(tokens, h, generator=g).bfloat16().to(device).requires_grad_(True)
    grad = (torch.randn(token_of.numel(), h, generator=g) * 5).bfloat16().to(device)
    grad[~live] = float("nan")
    x = _RoutedRows.apply(hs, token_of, rows_of, padded)
    (got,) = torch.autograd.grad(x, hs, grad)
    ref_rows = hs.detach().clone().requires_grad_(True)
    (ref,) = torch.autograd.grad(ref_rows[token_of[live]], ref_rows, grad[live])
    assert torch.equal(x[live], hs.detach()[token_of[live]])
    if padded:
        assert not x[~live].any()
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("recipe", [Float8CurrentScaling, NVFP4BlockScaling],
                         ids=["current", "nvfp4"])
def test_hugging_face_gradient_checkpointing_of_a_converted_moe_model(recipe, use_reentrant):
    """transformers' gradient checkpointing over a converted Qwen3-MoE model (the experts'
    grouped path recomputed in backward; NVFP4's stochastic rounding of dY included): the
    losses and gradients of two steps equal the run without it, bit for bit."""
    from same_run import assert_same_grads_and_states
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=128, intermediate_size=128,
                         num_experts=E, num_experts_per_tok=K, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         head_dim=32, use_cache=False)
    torch.manual_seed(0)
    a = lowprec.convert_model(Qwen3MoeForCausalLM(cfg))
    b = copy.deepcopy(a)
    b.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert any(isinstance(m, lowprec.GroupedExperts) for m in b.modules())
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    for step in range(2):
        losses = []
        for m in (a, b):
            torch.manual_seed(step)
            with lowprec.autocast(recipe=recipe()):
                loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(*losses)
        assert_same_grads_and_states(a, b)

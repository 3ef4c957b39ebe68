"""AdamW whose training state can be smaller than fp32: bf16 or FP8 moments, and bf16
weights with no fp32 master copy, all kept unbiased by stochastic rounding.

Plain bf16 state does not train like fp32 state under round-to-nearest: the second moment
decays by ``1 - beta2`` (0.1%) a step, less than half a bf16 unit (0.4%), so a decaying
value rounds back to where it was and sticks; an update smaller than half a unit of a
bf16 weight is lost the same way. Stochastic rounding (``rounding``) makes each stored
value its exact fp32 value on average, so small decays and updates accumulate.

The step is computed in fp32 with torch's AdamW arithmetic, op for op, over every
parameter of a dtype and state layout at once: on CUDA with Triton one fused kernel
launch (``launch``), which equals the reference's multi-tensor (``torch._foreach``) ops on
the same device bit for bit; elsewhere those ops. With fp32 state the step equals
``torch.optim.AdamW`` bit for bit.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..formats import REQUANTIZE_ATTR, QuantizedTensor
from . import fp8_state, launch
from .rounding import round_to_bf16_stochastic, stream_base, stream_key

MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
MASTER_WEIGHTS = ("fp32", "stochastic", None)
#: tensor ids of the random streams: three per parameter (exp_avg, exp_avg_sq, weight)
_STREAMS = 3


class AdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` (decoupled weight decay) with the state's precision chosen.

    ``exp_avg_dtype`` / ``exp_avg_sq_dtype``: ``torch.float32``, ``torch.bfloat16`` or
    ``torch.float8_e4m3fn`` (``fp8_state``: 128-element row blocks with power-of-two
    scales, the second moment kept as its square root; tensors of fewer than two
    dimensions keep bf16), the low-precision ones stored with stochastic rounding.
    ``master_weights`` for bf16/fp16 parameters: ``"fp32"`` keeps an fp32 copy that the
    step updates and the parameter is rounded from (to nearest); ``"stochastic"`` keeps
    none and updates a bf16 parameter in place with stochastic rounding; ``None`` keeps
    none and rounds to nearest (what a bf16 model under a plain fp32-math optimizer
    gets). fp32 parameters are their own master in every mode.
    ``seed`` fixes the random bits of the stochastic roundings: a step's bits depend on
    (seed, step, parameter, element) only, so a resumed run repeats an uninterrupted one.

    Bytes of persistent state per parameter of a bf16 model (gradients not counted):
    fp32 moments with fp32 masters 2 + 4 + 8 = 14; bf16 moments with fp32 masters 10;
    bf16 moments, ``master_weights="stochastic"`` 6; FP8 moments with it 2 + 2 * (1 + 4/128)
    = 4.06.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, maximize: bool = False,
                 amsgrad: bool = False, exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32,
                 master_weights: str | None = "fp32", seed: int = 0) -> None:
        if amsgrad:
            raise ValueError("lowprec.optim.AdamW: amsgrad=True is not supported (it keeps a "
                             "running maximum of exp_avg_sq); use torch.optim.AdamW for it")
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype),
                            ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in MOMENT_DTYPES:
                raise ValueError(f"lowprec.optim.AdamW: {name}={dtype}; use one of "
                                 f"{[str(d) for d in MOMENT_DTYPES]}")
        if master_weights not in MASTER_WEIGHTS:
            raise ValueError(f"lowprec.optim.AdamW: master_weights={master_weights!r}; use one "
                             f"of {MASTER_WEIGHTS}")
        if not 0.0 <= lr or not 0.0 <= eps or not 0.0 <= weight_decay:
            raise ValueError(f"lowprec.optim.AdamW: lr={lr}, eps={eps} and "
                             f"weight_decay={weight_decay} must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"lowprec.optim.AdamW: betas={betas}; two values in [0, 1)")
        if type(seed) is not int:
            raise TypeError(f"lowprec.optim.AdamW: seed={seed!r}; an int")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        maximize=maximize, exp_avg_dtype=exp_avg_dtype,
                        exp_avg_sq_dtype=exp_avg_sq_dtype, master_weights=master_weights,
                        seed=seed)
        super().__init__(params, defaults)  # checks each group through add_param_group

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        _check_group(self.param_groups[-1])

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter with a gradient; returns ``closure()``'s
        loss where given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            batches: dict[tuple, list] = {}
            for p in group["params"]:
                pid, index = index, index + 1
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    _init_state(st, p, group)
                key = (p.device, p.dtype, isinstance(p, QuantizedTensor), tuple(sorted(st)))
                batches.setdefault(key, []).append((pid, p, st))
            for items in batches.values():
                _step_batch(items, group)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict``, keeping each state tensor's dtype (the
        base class casts floating-point state to its parameter's dtype, which would round
        an fp32 master to a bf16 parameter's precision)."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for pid, p in zip(saved_group["params"], group["params"]):
                for k, v in saved.get(pid, {}).items():
                    if isinstance(v, torch.Tensor) and k != "step":
                        self.state[p][k] = v.to(device=p.device, copy=True)


def _check_group(group: dict) -> None:
    for p in group["params"]:
        if isinstance(p, QuantizedTensor):
            if getattr(p, REQUANTIZE_ATTR, None) is None:
                raise TypeError("lowprec.optim.AdamW takes quantized weights only as the "
                                "parameters of lowprec modules built under "
                                "quantized_model_init (it re-quantizes them with their "
                                f"module's quantizer); got a free {type(p).__name__}")
            if group["master_weights"] == "stochastic":
                raise ValueError("lowprec.optim.AdamW: master_weights='stochastic' rounds "
                                 "to bf16, which a quantized weight does not hold; use "
                                 "'fp32' (an fp32 master re-quantized after each step) or "
                                 "None")
            continue
        if isinstance(p, DTensor):
            if isinstance(p.to_local(), QuantizedTensor):
                raise TypeError("lowprec.optim.AdamW does not take FSDP2-sharded quantized "
                                "weights; shard high-precision weights (quantized all-"
                                "gathers: lowprec.distributed.quantized_all_gather)")
            if not all(pl.is_replicate() or (pl.is_shard() and pl.dim == 0)
                       for pl in p.placements):
                raise TypeError(f"lowprec.optim.AdamW takes DTensor parameters sharded along "
                                f"dim 0 or replicated (FSDP2's); got placements "
                                f"{tuple(p.placements)}")
        elif type(p) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"lowprec.optim.AdamW takes plain tensors and DTensors; got a "
                            f"{type(p).__name__} parameter")
        if not p.is_floating_point():
            raise TypeError(f"lowprec.optim.AdamW: a {p.dtype} parameter cannot be trained")
        low = p.dtype in (torch.bfloat16, torch.float16)
        if group["master_weights"] == "stochastic" and p.dtype == torch.float16:
            raise ValueError("lowprec.optim.AdamW: master_weights='stochastic' rounds to "
                             "bf16; an fp16 parameter needs master_weights='fp32' or None")
        if not low and p.dtype != torch.float32:
            raise TypeError(f"lowprec.optim.AdamW: {p.dtype} parameters are not supported "
                            f"(the step computes in fp32); use fp32, bf16 or fp16")


def _init_state(st: dict, p: torch.Tensor, group: dict) -> None:
    st["step"] = torch.tensor(0.0, dtype=torch.float32)
    for name, stored in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq_root")):
        dtype = group[name + "_dtype"]
        if dtype == fp8_state.E4M3 and p.dim() >= 2:
            st[stored] = _zeros(p, dtype)
            st[stored + "_scale"] = _zeros_by_rows(p, fp8_state.scale_shape(p.shape))
        else:  # vectors (norms, biases) keep bf16 state under FP8: a few bytes in all
            st[name] = _zeros(p, torch.bfloat16 if dtype == fp8_state.E4M3 else dtype)
    if group["master_weights"] == "fp32":
        if isinstance(p, QuantizedTensor):
            st["master"] = p.detach().dequantize(torch.float32)
        elif p.dtype in (torch.bfloat16, torch.float16):
            st["master"] = p.detach().float().clone(memory_format=torch.preserve_format)


def _zeros(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Contiguous zeros shaped and placed as ``p`` (a quantized weight: a plain tensor)."""
    if isinstance(p, QuantizedTensor):
        return torch.zeros(p.shape, dtype=dtype, device=p.device)
    return torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)


def _zeros_by_rows(p: torch.Tensor, shape: tuple) -> torch.Tensor:
    """fp32 zeros of ``shape`` (``p``'s leading dimensions, another last one), placed as
    ``p`` is: a DTensor sharded along dim 0 gets the same rows on each rank."""
    if not isinstance(p, DTensor):
        return torch.zeros(shape, dtype=torch.float32, device=p.device)
    local = torch.zeros((*p.to_local().shape[:-1], shape[-1]), dtype=torch.float32,
                        device=p.to_local().device)
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                              shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _moment(st: dict, name: str) -> torch.Tensor:
    """The fp32 working value of moment ``name`` (the tensor itself where stored fp32)."""
    if name == "exp_avg_sq" and "exp_avg_sq_root" in st:
        root = fp8_state.decode(st["exp_avg_sq_root"], st["exp_avg_sq_root_scale"])
        return root * root
    if name + "_scale" in st:
        return fp8_state.decode(st[name], st[name + "_scale"])
    t = st[name]
    return t if t.dtype == torch.float32 else t.float()


def _keep_moment(st: dict, name: str, value: torch.Tensor, key: int, offset: int) -> None:
    """Store the fp32 ``value`` of moment ``name`` as the state holds it: FP8 blocks (the
    second moment as its square root, which halves its range in binades), bf16, both with
    stochastic rounding, or fp32 (already in place)."""
    if name == "exp_avg_sq" and "exp_avg_sq_root" in st:
        fp8_state.encode_(st["exp_avg_sq_root"], st["exp_avg_sq_root_scale"],
                          torch.sqrt(value), key, offset)
    elif name + "_scale" in st:
        fp8_state.encode_(st[name], st[name + "_scale"], value, key, offset)
    else:
        _store([st[name]], [value], [key], [offset], True)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: in-place ops write the DTensor), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _offset(p: torch.Tensor) -> int:
    """The index in the whole tensor of the first element of ``p``'s local shard: 0 for a
    plain or replicated tensor; rows before this rank's for one sharded along dim 0 (so a
    stochastic rounding draws the same bits for an element on any number of ranks)."""
    if not isinstance(p, DTensor) or p.dim() == 0:
        return 0
    _, start = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return start[0] * (p.numel() // p.shape[0] if p.shape[0] else 0)


def _fp32(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 working copies (the tensors themselves where already fp32)."""
    return [t if t.dtype == torch.float32 else t.float() for t in ts]


def _store(dst: list[torch.Tensor], src: list[torch.Tensor], keys: list[int],
           offsets: list[int], stochastic: bool) -> None:
    """Write fp32 ``src`` into ``dst`` in place: nothing to do where they are the same
    tensor, bf16 with stochastic rounding where asked, else rounded to nearest."""
    for d, s, k, o in zip(dst, src, keys, offsets):
        if d is s:
            continue
        if stochastic and d.dtype == torch.bfloat16:
            d.copy_(round_to_bf16_stochastic(s, k, o))
        else:
            d.copy_(s)


def _step_batch(items: list, group: dict) -> None:
    """The step of parameters sharing device, dtype, kind and state layout."""
    counters = [st["step"] for _, _, st in items]
    torch._foreach_add_(counters, 1)
    steps = [int(s) for s in torch.stack(counters).tolist()]  # CPU tensors: no device sync
    if isinstance(items[0][1], QuantizedTensor):
        _step_quantized(items, group, steps)
        return
    pids = [i for i, _, _ in items]
    offsets = [_offset(p) for _, p, _ in items]
    # DTensors (FSDP2) step on their local shards
    params = [_local(p) for _, p, _ in items]
    states = [st if not isinstance(p, DTensor) else {k: _local(v) for k, v in st.items()}
              for _, p, st in items]
    grads = [_local(p.grad) for _, p, _ in items]
    _step_tensors(params, grads, states, offsets, pids, steps, group)


def _step_quantized(items: list, group: dict, steps: list) -> None:
    """Quantized weights (``quantized_model_init``): the step of their fp32 values (the
    master, or with ``master_weights=None`` the dequantized weight), each then re-quantized
    in place by its module's weight quantizer."""
    weights = [st["master"] if "master" in st else p.detach().dequantize(torch.float32)
               for _, p, st in items]
    states = [{k: v for k, v in st.items() if k != "master"} for _, _, st in items]
    grads = [p.grad.float() for _, p, _ in items]
    _step_tensors(weights, grads, states, [0] * len(items), [i for i, _, _ in items], steps,
                  group)
    for (_, p, _), w in zip(items, weights):
        getattr(p, REQUANTIZE_ATTR)(w, p)


def _step_tensors(params: list, grads: list, states: list, offsets: list, pids: list,
                  steps: list, group: dict) -> None:
    """The step of plain tensors: the fused kernel (``launch``) where it takes them, one
    launch per step count, else the reference; ``pids``: the parameters' indices in the
    optimizer, which name their random streams."""
    seed = group["seed"]
    if launch.takes(params, grads, states):
        fp8_rows = any(k.endswith("_scale") for k in states[0])
        for step in sorted(set(steps)):  # one launch per step count (almost always one)
            at = [i for i, s in enumerate(steps) if s == step]
            launch.adamw_step(*([lst[i] for i in at] for lst in (params, grads, states,
                                                                   offsets)),
                              [_STREAMS * pids[i] for i in at], group, step,
                              stream_base(seed, step), fp8_rows)
        return
    keys = [tuple(stream_key(seed, s, _STREAMS * pid + j) for j in range(_STREAMS))
            for pid, s in zip(pids, steps)]
    _reference_step(params, grads, states, offsets, keys, steps, group)


def _reference_step(params: list, grads: list, states: list, offsets: list, keys: list,
                    steps: list, group: dict) -> None:
    """The step in fp32 with torch's AdamW arithmetic in torch's order
    (``torch.optim.adamw._multi_tensor_adamw``), as multi-tensor torch ops."""
    lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
    if group["maximize"]:
        grads = torch._foreach_neg(grads)
    has_master = "master" in states[0]
    weights = [st["master"] for st in states] if has_master else _fp32(params)
    g32 = _fp32(grads)
    m32 = [_moment(st, "exp_avg") for st in states]
    v32 = [_moment(st, "exp_avg_sq") for st in states]
    if group["weight_decay"] != 0:
        torch._foreach_mul_(weights, 1 - lr * group["weight_decay"])
    torch._foreach_lerp_(m32, g32, 1 - beta1)
    torch._foreach_mul_(v32, beta2)
    torch._foreach_addcmul_(v32, g32, g32, 1 - beta2)
    step_sizes = [-(lr / (1 - beta1 ** s)) for s in steps]
    bc2_sqrt = [(1 - beta2 ** s) ** 0.5 for s in steps]
    denom = torch._foreach_sqrt(v32)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(weights, m32, denom, step_sizes)
    for st, m, v, (km, kv, _), o in zip(states, m32, v32, keys, offsets):
        _keep_moment(st, "exp_avg", m, km, o)
        _keep_moment(st, "exp_avg_sq", v, kv, o)
    _store(params, weights, [k[2] for k in keys], offsets,
           group["master_weights"] == "stochastic")

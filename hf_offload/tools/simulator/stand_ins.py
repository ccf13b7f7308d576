"""Where the simulated step, on the meta device, must be told what a real GPU would do.

- SDPA on meta tensors takes the math path, which materialises the sequence-by-sequence
  attention weights. `attention_as_on_cuda` has `torch.nn.functional.scaled_dot_product_attention`
  call the kernel CUDA's dispatch would pick on the simulated device (`sdpa_kernel`: flash
  attention, the memory-efficient one, or the math path, by dtype, head dimension, mask and
  compute capability), the CUDA op itself, whose meta kernel gives its outputs and whose backward
  autograd saves and runs as on a GPU; a boolean mask becomes the additive one of the query's
  dtype that SDPA makes for the memory-efficient kernel, padded to 16 columns. (The function is
  replaced rather than intercepted by a TorchFunctionMode: those are not active in backward,
  where a checkpoint recomputes its layer.)
- transformers' masking cannot look at position ids or at a padding mask without data:
  `find_packed_sequence_indices` asks whether positions restart inside a row, `fast_all` whether
  any position is padding. `real_device_masking` answers as a GPU would for the batch simulated:
  not packed, and padded or not as the training says. (Unanswered, a mask of sequence x sequence
  is built: 12 GiB at 64k tokens.)
- CUDA's autocast does nothing to meta tensors. `autocast_as_on_cuda` casts what CUDA's autocast
  casts while the CPU's autocast is on (the flag checkpoints and tiling replay in backward): the
  inputs of matmuls, linear layers and attention to its dtype, those of softmax, log-softmax,
  cross-entropy and norms to float32, caching the casts of leaf tensors that require grad until
  the outermost autocast ends, as CUDA does.
- Libraries open autocast regions on their tensors' device (`torch.autocast(device_type=W.device.type,
  ...)`: PEFT 0.22's LoRA on expert parameters; TRL asks `torch.is_autocast_enabled(device.type)`),
  and PyTorch has no autocast for "meta". `autocast_regions_on_meta` answers "meta" as the CPU's
  autocast, the flag that stands for CUDA's in the simulated step: a region that switches autocast
  off on a GPU switches it off here too.
- Liger's fused linear cross-entropy is Triton, which runs nothing on meta tensors.
  `SimulatedFusedLinearCrossEntropy` makes the allocations Liger 0.8.5's
  `fused_linear_cross_entropy_forward` makes on CUDA, in the same order, without computing.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from hf_offload.internal import replaced, resolve
from hf_offload.tiling.ulysses_heads import attention_in_head_chunks, chunk_plan

FLASH, EFFICIENT, MATH = "flash", "efficient", "math"
_HALF = (torch.float16, torch.bfloat16)


def sdpa_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask, dropout_p: float,
                is_causal: bool, capability: tuple[int, int]) -> str:  # fmt: skip
    """The kernel PyTorch's CUDA dispatch (sdp_utils.cpp, flash first) picks on a device of this
    compute capability: flash attention takes half precision, no mask, head dimensions up to 256
    on sm80 and later, except in training on sm86-sm89 (and sm120) with head dimensions in
    (192, 224], or above 224 with dropout, where its backward has no kernel; the memory-efficient
    kernel takes a mask and float32 too, head dimensions aligned to 8 (4 in float32); else math.
    (cuDNN attention, which builds with cuDNN newer than 9.15 prefer on sm90 and sm100, is not
    simulated: flash is.)"""
    head = query.shape[-1]
    same_head = key.shape[-1] == head and value.shape[-1] == head
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    consumer = (8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)
    backward_kernel = not (training and consumer) or head <= 192 or (dropout_p == 0.0 and head > 224)
    square = not is_causal or query.shape[-2] == key.shape[-2]
    if (attn_mask is None and same_head and head <= 256 and (8, 0) <= capability <= (12, 1)
            and query.dtype in _HALF and backward_kernel and square):  # fmt: skip
        return FLASH
    alignment = 8 if query.dtype in _HALF and capability >= (8, 0) else 4
    dtypes = (*_HALF, torch.float32) if capability >= (8, 0) else (torch.float16, torch.float32)
    if ((5, 0) <= capability <= (12, 1) and key.shape[-1] == head and head % alignment == 0
            and value.shape[-1] % alignment == 0 and query.dtype in dtypes):  # fmt: skip
        return EFFICIENT
    return MATH


def _as_bias(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """SDPA's preparation of a mask for the memory-efficient kernel: a boolean mask becomes an
    additive one of the query's dtype (-inf where masked), expanded to (batch, heads, queries,
    keys), its last dimension padded to a multiple of 16."""
    if mask.dtype == torch.bool:
        bias = torch.zeros_like(mask, dtype=query.dtype)
        bias.masked_fill_(mask.logical_not(), float("-inf"))
        mask = bias
    mask = mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    columns = mask.shape[-1]
    if columns % 16:
        padded = torch.nn.functional.pad(mask, (0, 16 - columns % 16))
        mask = padded[..., :columns]
    return mask


@contextlib.contextmanager
def attention_as_on_cuda(capability: tuple[int, int] = (9, 0)) -> Iterator[None]:
    """`scaled_dot_product_attention` as CUDA dispatches it on a device of this compute
    capability (`sdpa_kernel`), for meta tensors; and as CUDA's autocast casts its inputs."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not query.is_meta:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        query, key, value = _autocast_to_lower(query, key, value)
        kernel = sdpa_kernel(query, key, value, attn_mask, dropout_p, is_causal, capability)
        if kernel == FLASH:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        if kernel == EFFICIENT:
            if key.shape[-3] != query.shape[-3]:  # grouped-query attention: the kernel's heads, repeated
                repeats = query.shape[-3] // key.shape[-3]
                key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
            bias = None if attn_mask is None else _as_bias(attn_mask, query, key)
            logsumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, logsumexp, dropout_p, is_causal, scale=scale
            )[0]
        return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


@contextlib.contextmanager
def real_device_masking(padded: bool = False) -> Iterator[None]:
    """transformers' mask decisions on meta tensors as on a device with data: no packed sequences,
    and a batch padded or not as given (meta tensors hold no data to tell)."""
    original_all = resolve("transformers.fast_all")
    resolve("transformers.find_packed_sequence_indices")

    def fast_all(tensor):
        return original_all(tensor) if not tensor.is_meta else not padded

    with (
        replaced("transformers.find_packed_sequence_indices", lambda position_ids: None),
        replaced("transformers.fast_all", fast_all),
    ):
        yield


# -- autocast ---------------------------------------------------------------------------------------

_autocast_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(leaf) -> (leaf, its cast)
_autocast_hooks: list = []  # what allocates a cached cast: the simulator counts it in its step


def _autocast_dtype() -> torch.dtype | None:
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def _cast(value, dtype: torch.dtype):
    """CUDA autocast's cast of one argument: floating meta tensors other than float64 and of another
    dtype; a leaf requiring grad once per autocast region (cached)."""
    if not (isinstance(value, torch.Tensor) and value.is_meta and value.is_floating_point()):
        return value
    if value.dtype in (dtype, torch.float64):
        return value
    if value.is_leaf and value.requires_grad and torch.is_autocast_cache_enabled():
        cached = _autocast_cache.get(id(value))
        if cached is None or cached[0] is not value:
            with contextlib.ExitStack() as stack:
                for hook in _autocast_hooks:
                    stack.enter_context(hook())
                cached = _autocast_cache[id(value)] = (value, value.to(dtype))
        return cached[1]
    return value.to(dtype)


def _autocast_to_lower(*tensors):
    dtype = _autocast_dtype()
    if dtype is None:
        return tensors
    return tuple(_cast(t, dtype) for t in tensors)


def _wrap(function, to_float32: bool):
    def wrapped(*args, **kwargs):
        dtype = _autocast_dtype()
        if dtype is None:
            return function(*args, **kwargs)
        target = torch.float32 if to_float32 else dtype
        args = tuple(_cast(a, target) for a in args)
        kwargs = {name: _cast(value, target) for name, value in kwargs.items()}
        return function(*args, **kwargs)

    wrapped.__wrapped__ = function
    return wrapped


# What CUDA's autocast casts, among the functions transformers' models call (PyTorch's autocast op
# lists): to its dtype the inputs of matmuls and linear layers (and attention's, in
# attention_as_on_cuda); to float32 those of softmaxes, losses and norms. Tensor methods are not
# intercepted (`a @ b` among them: rotary embeddings, which run with autocast off on a GPU).
_TO_LOWER = [(torch.nn.functional, "linear"), (torch.nn.functional, "bilinear"), (torch.nn.functional, "conv1d"),
             (torch.nn.functional, "conv2d"), (torch, "matmul"), (torch, "mm"), (torch, "bmm"), (torch, "addmm"),
             (torch, "baddbmm"), (torch, "addbmm")]  # fmt: skip
_TO_FLOAT32 = [
    (torch.nn.functional, name)
    for name in ("softmax", "log_softmax", "cross_entropy", "nll_loss", "layer_norm", "group_norm", "mse_loss",
                 "softplus", "kl_div", "binary_cross_entropy_with_logits")
]  # fmt: skip
_AUTOCAST_FUNCTIONS = [(module, name, False) for module, name in _TO_LOWER] + [
    (module, name, True) for module, name in _TO_FLOAT32
]


@contextlib.contextmanager
def autocast_as_on_cuda(on_cached_cast=None) -> Iterator[None]:
    """While the CPU's autocast is on, meta tensors are cast as CUDA's autocast casts CUDA ones
    (module docstring). `on_cached_cast()`, a context manager, is entered around each cached
    cast: the cache outlives the call that made it."""
    originals = [(module, name, getattr(module, name)) for module, name, _ in _AUTOCAST_FUNCTIONS]
    clear = torch.clear_autocast_cache

    def clear_autocast_cache():
        _autocast_cache.clear()
        clear()

    for (module, name, to_float32), (_m, _n, function) in zip(_AUTOCAST_FUNCTIONS, originals, strict=True):
        setattr(module, name, _wrap(function, to_float32))
    torch.clear_autocast_cache = clear_autocast_cache
    if on_cached_cast is not None:
        _autocast_hooks.append(on_cached_cast)
    try:
        yield
    finally:
        for module, name, function in originals:
            setattr(module, name, function)
        torch.clear_autocast_cache = clear
        _autocast_cache.clear()
        if on_cached_cast is not None:
            _autocast_hooks.remove(on_cached_cast)


class _AutocastOnMeta(torch.amp.autocast_mode.autocast):
    """`torch.autocast` for the simulated step: a region on "meta" is one on the CPU (module docstring)."""

    def __init__(self, device_type: str, *args, **kwargs) -> None:
        super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)


def _on_meta_as_cpu(function):
    def answer(device_type=None, *args):
        if device_type is None:
            return function(*args)
        return function("cpu" if device_type == "meta" else device_type, *args)

    answer.__wrapped__ = function
    return answer


@contextlib.contextmanager
def autocast_regions_on_meta() -> Iterator[None]:
    """Within the block, autocast's queries and regions for the "meta" device are the CPU's."""
    replaced_names = [
        (torch, "autocast", _AutocastOnMeta),
        (torch, "is_autocast_enabled", _on_meta_as_cpu(torch.is_autocast_enabled)),
        (torch, "get_autocast_dtype", _on_meta_as_cpu(torch.get_autocast_dtype)),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in replaced_names]
    for owner, name, value in replaced_names:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class SimulatedFusedLinearCrossEntropy(torch.autograd.Function):
    """Liger's `LigerFusedLinearCrossEntropyFunction` (0.8.5, mean or sum reduction, as its
    causal-LM forward calls it), for meta tensors only: the loss and both gradients are produced
    in forward, a chunk of tokens at a time, through one reused logits buffer of
    `next_power_of_2(ceil(tokens / ceil(vocab / hidden)))` rows; backward scales the saved
    gradients in place. On CUDA Liger writes each chunk's logits, the gradient of the input and
    that of the weight with `out=` matmuls and in-place kernels, so those allocate nothing."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias=None, ce_weight=None, ignore_index=-100, *options):
        if not hidden.is_meta:
            raise RuntimeError("the simulated fused linear cross-entropy computes nothing: meta tensors only")
        tokens, width = hidden.shape
        vocab = weight.shape[0]
        chunk = min(_next_power_of_2(math.ceil(tokens / math.ceil(vocab / width))), tokens)
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        grad_bias = torch.zeros_like(bias) if bias is not None and bias.requires_grad else None
        losses = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        counted = target != ignore_index
        logits = torch.empty((chunk, vocab), dtype=hidden.dtype, device=hidden.device)
        for start in range(0, tokens, chunk):
            rows = slice(start, min(start + chunk, tokens))
            block = logits[: rows.stop - rows.start]
            torch.mm(hidden[rows], weight.t(), out=block)
            torch.mm(block, weight, out=grad_hidden[rows])
            if grad_weight is not None:
                grad_weight.addmm_(block.t(), hidden[rows])
        del logits, counted
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return losses.sum(), None, None, None

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        for gradient in (grad_hidden, grad_weight, grad_bias):
            if gradient is not None:
                gradient.mul_(grad_loss)
        return (grad_hidden, grad_weight, None, grad_bias) + (None,) * (len(ctx.needs_input_grad) - 4)


@contextlib.contextmanager
def simulated_liger_loss() -> Iterator[None]:
    """Liger's causal-LM forwards call its fused linear cross-entropy through this module global."""
    with replaced("liger-kernel.fused_linear_cross_entropy", SimulatedFusedLinearCrossEntropy):
        yield


# -- sequence parallelism (DeepSpeed Ulysses) -------------------------------------------------------


class UlyssesTraffic:
    """What one rank sends through the SP group's all-to-alls in a step (it receives as much)."""

    def __init__(self, sp_size: int) -> None:
        self.sp_size = sp_size
        self.sent_bytes = 0
        self.calls = 0

    def send(self, buffer: torch.Tensor) -> None:
        # Of each all-to-all buffer, the share addressed to this rank itself never leaves it.
        self.sent_bytes += buffer.numel() * buffer.element_size() * (self.sp_size - 1) // self.sp_size
        self.calls += 1


class _AllToAll(torch.autograd.Function):
    """DeepSpeed's all-to-all over dimension 0 (`_dim_zero_all_to_all`) on meta tensors: the
    received buffer is a fresh one of the sent one's shape, and its backward is the same exchange
    in reverse, so both directions allocate and are counted as traffic."""

    @staticmethod
    def forward(ctx, buffer: torch.Tensor, traffic: UlyssesTraffic) -> torch.Tensor:
        ctx.traffic = traffic
        traffic.send(buffer)
        return torch.empty_like(buffer)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.traffic.send(grad)
        return torch.empty_like(grad), None


def _ulysses_attention(core, sp_size: int, traffic: UlyssesTraffic):
    """The attention function as DeepSpeed's `UlyssesSPAttentionHF` runs it around `core`, for
    meta tensors: the same reshapes and copies, in the same order, so the buffers it holds are
    counted; the collectives are `_AllToAll`. The shard's (batch, heads, seq / sp, head_dim)
    query, key and value become (batch, heads / sp, seq, head_dim) for `core`, and its output goes
    back to the shard's tokens with every head. Where the module's attention is tiled over heads,
    hf_offload's exchange of a chunk of query heads at a time runs instead, as in training
    (`hf_offload.tiling.ulysses_heads`)."""

    def exchange(buffer: torch.Tensor) -> torch.Tensor:
        return _AllToAll.apply(buffer, traffic)

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if not query.is_meta:
            raise RuntimeError("the simulated Ulysses attention exchanges nothing: meta tensors only")
        # Attention tiled over heads: the product's own exchange a chunk of query heads at a time,
        # around the stand-in all-to-all (hf_offload.integrations.sequence_parallel does the same
        # around DeepSpeed's).
        plan = None if args or attention_mask is not None else chunk_plan(module, query, key, sp_size, kwargs)
        if plan is not None:
            return attention_in_head_chunks(
                module, query, key, value, None, plan=plan, exchange=exchange, core=core, **kwargs
            )
        batch, heads, local, head_dim = query.shape
        kv_heads = key.shape[1]
        # Fewer key/value heads than ranks: DeepSpeed repeats them so that each rank gets one.
        replication = max(sp_size // kv_heads, 1)

        def gather(tensor, local_heads, repeats):
            tensor = tensor.permute(2, 0, 1, 3)  # (seq / sp, batch, heads, head_dim)
            if repeats > 1:
                tensor = tensor.repeat_interleave(repeats, dim=2)
            tensor = tensor.reshape(local, batch, sp_size, local_heads, head_dim)
            tensor = tensor.permute(2, 0, 1, 3, 4).contiguous()
            received = exchange(tensor)
            received = received.reshape(sp_size * local, batch, local_heads, head_dim).contiguous()
            return received.permute(1, 2, 0, 3).contiguous()  # (batch, heads / sp, seq, head_dim)

        query = gather(query, heads // sp_size, 1)
        key = gather(key, kv_heads * replication // sp_size, replication)
        value = gather(value, kv_heads * replication // sp_size, replication)
        groups = getattr(module, "num_key_value_groups", None)
        if groups is not None:
            module.num_key_value_groups = query.shape[1] // key.shape[1]
        try:
            context, weights = core(module, query, key, value, attention_mask, *args, **kwargs)
        finally:
            if groups is not None:
                module.num_key_value_groups = groups
        # (batch, seq, heads / sp, head_dim) back to (batch, seq / sp, heads x head_dim)
        context = context.permute(1, 0, 2, 3).reshape(sp_size * local, batch, -1)
        context = context.reshape(sp_size, local, batch, context.shape[-1]).contiguous()
        received = exchange(context)
        output = received.permute(1, 2, 0, 3).reshape(local, batch, -1).contiguous()
        output = output.permute(1, 0, 2).reshape(batch, local, -1)
        return output, weights

    attention._hf_offload_ulysses_of = core
    return attention


@contextlib.contextmanager
def simulated_ulysses(implementation: str, sp_size: int, traffic: UlyssesTraffic) -> Iterator[None]:
    """Transformers' attention function `implementation` wrapped as Ulysses wraps it, for one rank
    of `sp_size` (the model runs on the rank's seq / sp_size tokens). Entered after tiling's
    wrappers, so attention tiled over heads runs inside, on the gathered sequence, as it would on
    a GPU."""
    mapping = resolve("transformers.attention_registry")
    core = mapping[implementation]
    mapping[implementation] = _ulysses_attention(core, sp_size, traffic)
    try:
        yield
    finally:
        mapping[implementation] = core
